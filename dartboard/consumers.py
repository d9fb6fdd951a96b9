"""Channels consumers: the live feed of one run (env wall tiles, charts, statuses)."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from datamanager.events import run_group
from datamanager.roles import CAN_VIEW


class RunEventsConsumer(AsyncJsonWebsocketConsumer):
    """Forwards a run's events to a browser whose user may view runs. Anonymous sockets are
    closed with 4401, those of users without the viewer permission with 4403."""

    group: str | None = None

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        if not await database_sync_to_async(user.has_perm)(CAN_VIEW):
            await self.close(code=4403)
            return
        self.group = run_group(int(self.scope["url_route"]["kwargs"]["run_id"]))
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def run_event(self, event: dict) -> None:
        await self.send_json({"kind": event["kind"], "data": event["data"]})
