"""Channels consumers: the live feed of one run (env wall tiles, charts, statuses)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from datamanager.events import SLOT_KINDS, run_group, slot_group
from datamanager.roles import CAN_VIEW

# Most slot groups one socket joins (a wall page shows at most this many tiles).
MAX_SLOTS = 500

# A socket sends what gathered at most this often: a tile changes at most 1 / FLUSH_S times a
# second however fast its slot steps (an OSWorld step takes seconds, a simulated one less).
FLUSH_S = 0.25

# The run's own events (versions, groups, updates) a socket holds for a browser that does not
# read; past it the oldest go. They are hints to refetch (charts.js), so the newest matter.
MAX_RUN_EVENTS = 100


def _wanted_slots(query: bytes) -> list[int] | None:
    """`?slots=all`: every slot (None); `?slots=1,2,3`: those; absent: none ([])."""
    raw = parse_qs(query.decode()).get("slots", [""])[0]
    if raw == "all":
        return None
    return [int(s) for s in raw.split(",") if s.isdigit()][:MAX_SLOTS]


class Outbox:
    """The events waiting for one browser, coalesced: one per (kind, slot) for a slot's events
    (the newest wins: a tile shows its latest screenshot, not each one it missed), and the
    run's own in order, at most MAX_RUN_EVENTS. Its size is bounded by the socket's slots
    whatever the event rate, so a browser that stops reading costs a bounded amount of
    memory and never holds up a writer. Single-threaded (the consumer's event loop)."""

    def __init__(self) -> None:
        self._slots: dict[tuple[str, Any], dict[str, Any]] = {}
        self._run: deque[dict[str, Any]] = deque(maxlen=MAX_RUN_EVENTS)
        self.ready = asyncio.Event()
        self.merged = 0  # events replaced by a newer one before they were sent

    def event_add(self, *, kind: str, data: dict[str, Any]) -> None:
        message = {"kind": kind, "data": data}
        slot = data.get("slot")
        if kind in SLOT_KINDS and slot is not None:
            # Re-inserted at the end: a flush sends in the order of each key's newest event.
            if self._slots.pop((kind, slot), None) is not None:
                self.merged += 1
            self._slots[(kind, slot)] = message
        else:
            if len(self._run) == self._run.maxlen:
                self.merged += 1
            self._run.append(message)
        self.ready.set()

    def take(self) -> list[dict[str, Any]]:
        """Everything waiting, the run's events first; empties the outbox."""
        messages = [*self._run, *self._slots.values()]
        self._run.clear()
        self._slots.clear()
        self.ready.clear()
        return messages


class RunEventsConsumer(AsyncJsonWebsocketConsumer):
    """Forwards a run's events to a browser whose user may view runs: the run's own, and
    those of the env slots it asks for (`?slots=all`, or the ids on its page of the wall).
    Anonymous sockets are closed with 4401, those of users without the viewer permission
    with 4403.

    An event only lands in the socket's `Outbox`; a task of the socket's own sends what
    gathered, then waits FLUSH_S before the next send. While a browser reads slowly its
    sends wait (the server's flow control) and its outbox coalesces meanwhile: the browser
    skips to the newest state, and neither the channel layer nor another socket waits."""

    groups_joined: Sequence[str] = ()
    outbox: Outbox | None = None
    _flusher: asyncio.Task | None = None

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
        self.outbox = Outbox()
        self._flusher = asyncio.create_task(self._flush_forever(self.outbox))
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            # A send that failed as the browser left ended the task already: nothing to add.
            await asyncio.gather(self._flusher, return_exceptions=True)
        for group in self.groups_joined:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def run_event(self, event: dict) -> None:
        if self.outbox is not None:
            self.outbox.event_add(kind=event["kind"], data=event["data"])

    async def _flush_forever(self, outbox: Outbox) -> None:
        while True:
            await outbox.ready.wait()
            for message in outbox.take():
                await self.send_json(message)
            await asyncio.sleep(FLUSH_S)
