"""The synchronous baseline's turn-by-turn barrier on a real Redis, and the environment
busy clock behind the utilisation figures."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from django.conf import settings

from envmanager.busy import BusyClock
from workers.lockstep import RedisLockstep


def _lockstep(members: int, timeout_s: float = 30.0, key: str | None = None) -> RedisLockstep:
    return RedisLockstep(
        redis_url=settings.REDIS_URL,
        key=key or f"dartboard:lockstep:test:{uuid.uuid4().hex}",
        members=members,
        timeout_s=timeout_s,
    )


def test_members_take_each_turn_together_and_an_ended_member_stops_counting():
    """Three members: 'short' ends after turn 0, 'slow' arrives late at every turn. Nobody
    passes a turn before every member still playing has arrived at it, and after 'short'
    left, the other two go on without waiting for it (no timeout)."""
    key = f"dartboard:lockstep:test:{uuid.uuid4().hex}"
    arrived: dict[tuple[str, int], float] = {}
    released: dict[tuple[str, int], float] = {}
    plans = {"short": (1, 0.0), "fast": (3, 0.0), "slow": (3, 0.3)}

    def member(name: str) -> None:
        turns, delay = plans[name]
        pacer = _lockstep(3, timeout_s=10, key=key)
        for t in range(turns):
            time.sleep(delay)
            arrived[(name, t)] = time.monotonic()
            pacer.turn(t)
            released[(name, t)] = time.monotonic()
        pacer.leave()
        assert not pacer.broken

    threads = [threading.Thread(target=member, args=(n,)) for n in plans]
    started = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=20)
    assert len(released) == 7
    for t in range(3):
        playing = [n for n, (turns, _) in plans.items() if turns > t]
        last_arrival = max(arrived[(n, t)] for n in playing)
        assert all(released[(n, t)] >= last_arrival for n in playing)
    # 'fast' waited for 'slow' at every turn (ordering checked above), and no turn ran
    # into the 10 s timeout.
    assert released[("fast", 2)] - started < 10


def test_a_member_that_never_arrives_times_out_once_with_a_warning(caplog):
    pacer = _lockstep(2, timeout_s=2.0)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="dartboard.lockstep"):
        pacer.turn(0)
    assert time.monotonic() - started >= 2.0
    assert pacer.broken
    assert "turn 0 waited 2.0 s with 1 of 2 members" in caplog.text
    started = time.monotonic()
    pacer.turn(1)  # the round is broken: no second wait of the timeout
    assert time.monotonic() - started < 2.0
    pacer.leave()
    pacer.leave()  # twice is harmless


def test_a_round_needs_members():
    with pytest.raises(ValueError, match="at least one member, got 0"):
        _lockstep(0)


def test_busy_clock_counts_the_call_under_way():
    now = [100.0]
    clock = BusyClock(now=lambda: now[0])
    clock.start()
    now[0] += 0.2
    assert clock.seconds() == pytest.approx(0.2)  # a reader mid-call sees the time so far
    now[0] += 0.2
    clock.stop()
    now[0] += 5.0  # idle time is not busy time
    assert clock.seconds() == pytest.approx(0.4)
    clock.start()
    now[0] += 1.0
    clock.stop()
    assert clock.seconds() == pytest.approx(1.4)
