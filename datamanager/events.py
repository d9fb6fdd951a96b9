"""Dashboard events: published to a run's Channels group after the DB transaction commits.

Producers (env slots, the trainer) call `publish_on_commit`; each is one PUBLISH per group on
the publish/subscribe channel layer (settings.CHANNEL_LAYERS), whoever watches; the consumer in
`dartboard/consumers.py` forwards the events to the browsers watching the run, at most a few
times a second per tile.

Publishing is fire-and-forget on one background event loop per process: a step never waits
for Redis (measured: ~3 ms per event with a fresh `async_to_sync` loop, ~0.05 ms queued).
Events are live-view hints; the database stays the record, so an event lost to a Redis
outage or a process exit costs a stale tile until the next one, never data.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from typing import Any

from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger(__name__)


def run_group(run_id: int) -> str:
    """The run's own events (versions, groups, updates): every page of the run gets them."""
    return f"run-{run_id}"


def slot_group(run_id: int, slot: int | str | None) -> str:
    """One slot's events (`SLOT_KINDS`); `slot` None: every slot's (an unpaged wall)."""
    return f"run-{run_id}-slots" if slot is None else f"run-{run_id}-slot-{slot}"


# Events about one env slot go to that slot's group and to the every-slot group, not to the
# run's: a browser on page 1 of a 1,000-slot wall subscribes to its 100 slots and gets only
# their events (dartboard/consumers.py).
SLOT_KINDS = frozenset({"step", "slot", "trajectory"})


# Sends in flight at once per process; the rest wait their turn on the loop. Unbounded, a
# process serving 167 slots on a saturated machine (bench/scale.py, 1,000 slots) ran past
# the channel layer's pool of 100 Redis connections and lost events to MaxConnectionsError.
MAX_IN_FLIGHT = 32


class _Publisher:
    """A daemon thread running an asyncio loop that owns this process's channel layer."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._in_flight: asyncio.Semaphore | None = None

    async def _send(self, layer: Any, groups: list[str], message: dict[str, Any]) -> None:
        if self._in_flight is None:  # created on the loop's thread, where it is used
            self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        async with self._in_flight:
            for group in groups:
                await layer.group_send(group, message)

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or not self._loop.is_running():
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(started.set)
                    loop.run_forever()

                threading.Thread(target=run, name="dartboard-events", daemon=True).start()
                started.wait(5)
                self._loop, self._in_flight = loop, None
            return self._loop

    def send(self, groups: list[str], message: dict[str, Any]) -> Future:
        layer = get_channel_layer()
        if layer is None:
            done: Future = Future()
            done.set_result(None)
            return done
        future = asyncio.run_coroutine_threadsafe(
            self._send(layer, groups, message), self._ensure_loop()
        )
        future.add_done_callback(_log_failure)
        return future


def _log_failure(future: Future) -> None:
    exc = future.exception()
    if exc is not None:
        log.error("could not publish a dashboard event: %s: %s", type(exc).__name__, exc)


_publisher = _Publisher()


def publish(*, run_id: int, kind: str, data: dict[str, Any]) -> Future:
    """Queue one event for the run's watchers now; returns a future (tests may wait on it)."""
    slot = data.get("slot")
    if kind in SLOT_KINDS and slot is not None:
        groups = [slot_group(run_id, slot), slot_group(run_id, None)]
    else:
        groups = [run_group(run_id)]
    return _publisher.send(groups, {"type": "run.event", "kind": kind, "data": data})


def publish_on_commit(*, run_id: int, kind: str, data: dict[str, Any]) -> None:
    transaction.on_commit(lambda: publish(run_id=run_id, kind=kind, data=data))
