"""Channels consumers: the live feed of one run (env wall tiles, charts, statuses)."""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from datamanager.events import run_group, slot_group
from datamanager.roles import CAN_VIEW

# Most slot groups one socket joins (a wall page shows at most this many tiles).
MAX_SLOTS = 500


def _wanted_slots(query: bytes) -> list[int] | None:
    """`?slots=all`: every slot (None); `?slots=1,2,3`: those; absent: none ([])."""
    raw = parse_qs(query.decode()).get("slots", [""])[0]
    if raw == "all":
        return None
    return [int(s) for s in raw.split(",") if s.isdigit()][:MAX_SLOTS]


class RunEventsConsumer(AsyncJsonWebsocketConsumer):
    """Forwards a run's events to a browser whose user may view runs: the run's own, and
    those of the env slots it asks for (`?slots=all`, or the ids on its page of the wall).
    Anonymous sockets are closed with 4401, those of users without the viewer permission
    with 4403."""

    groups_joined: Sequence[str] = ()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        if not await database_sync_to_async(user.has_perm)(CAN_VIEW):
            await self.close(code=4403)
            return
        run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        slots = _wanted_slots(self.scope.get("query_string", b""))
        self.groups_joined = [run_group(run_id)] + (
            [slot_group(run_id, None)] if slots is None else [slot_group(run_id, s) for s in slots]
        )
        for group in self.groups_joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        for group in self.groups_joined:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def run_event(self, event: dict) -> None:
        await self.send_json({"kind": event["kind"], "data": event["data"]})
