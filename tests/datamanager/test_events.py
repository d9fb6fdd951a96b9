"""Dashboard events: a burst of publishes keeps a bounded number of sends in flight."""

from __future__ import annotations

import asyncio

from datamanager import events


class SlowLayer:
    """A channel layer whose sends take 20 ms, counting how many run at once."""

    def __init__(self) -> None:
        self.now = self.most = self.sent = 0

    async def group_send(self, group: str, message: dict) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(0.02)
        self.now -= 1
        self.sent += 1


def test_a_burst_of_300_events_is_sent_whole_with_a_bounded_number_in_flight(monkeypatch):
    layer = SlowLayer()
    monkeypatch.setattr(events, "get_channel_layer", lambda: layer)
    monkeypatch.setattr(events, "_publisher", events._Publisher())
    futures = [events.publish(run_id=1, kind="step", data={"step": i}) for i in range(300)]
    for f in futures:
        f.result(timeout=30)
    assert layer.sent == 300
    assert layer.most == events.MAX_IN_FLIGHT  # unbounded, all 300 were in flight at once
