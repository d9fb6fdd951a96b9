"""Leases on live work (datamanager/live_work.py names it and enqueues it): an env slot, a
run's trainer or an evaluation shard is a long-running Celery task that at most one live
worker holds at a time.

A lease is a Redis key with a TTL (settings.DARTBOARD_LEASE_TTL_S) that its holder renews; a
killed holder's lease lapses within the TTL. The pending marker `work_enqueue` sets is
cleared when a worker starts the task (`work_started`), so the watchdog (workers/watchdog.py)
can tell work that is waiting in a queue from work whose worker died, and re-enqueues only
the latter. The watchdog also looks for the message itself in the broker's queue
(`QueuedTasks`): a marker whose message is gone (a Redis restart without its data, a message
stranded with a dead connection) is lost work, not waiting work.

Redis outages: a lease keeper rides out an outage and takes its lease again when Redis is
back, unless another holder took it meanwhile (then it says so and its holder stops).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import threading
import time
from typing import Any, cast

from django.conf import settings

from datamanager.live_work import REDIS_DOWN, LiveWork, redis_client, redis_retry

log = logging.getLogger("dartboard.leases")


def work_started(work: LiveWork) -> None:
    """Called by the task as it starts: its message has left the queue."""
    client = redis_client()
    try:
        client.delete(work.pending_key)
    finally:
        client.close()


# kombu's Redis transport keeps a queue's messages in a list named after it, plus one list
# per priority step (name + this separator + step) for messages sent with a priority.
_PRIORITY_SEP = "\x06\x16"
_PRIORITY_STEPS = (3, 6, 9)


class QueuedTasks:
    """The tasks waiting in the broker's queues, read once per queue (one LRANGE each) and
    kept for this object's life: the watchdog makes one per pass."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._queues: dict[str, set[tuple[str, tuple[Any, ...]]]] = {}

    def holds(self, work: LiveWork) -> bool:
        if work.queue not in self._queues:
            self._queues[work.queue] = self._read(work.queue)
        return (work.task, tuple(work.args)) in self._queues[work.queue]

    def _read(self, queue: str) -> set[tuple[str, tuple[Any, ...]]]:
        found = set()
        names = [queue, *(f"{queue}{_PRIORITY_SEP}{step}" for step in _PRIORITY_STEPS)]
        for name in names:
            for raw in self.client.lrange(name, 0, -1):
                task = _message_task(raw)
                if task is not None:
                    found.add(task)
        return found


def _message_task(raw: bytes) -> tuple[str, tuple[Any, ...]] | None:
    """(task name, args) of one kombu message as the Redis transport stores it; None for a
    message that is not a Celery task of protocol 2 (nothing of ours)."""
    try:
        message = json.loads(raw)
        name = message["headers"]["task"]
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return str(name), tuple(args)
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def holder_name(what: str) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{what}"


# Check-and-set in one step on the server: between a GET and a SET another worker could
# take a lapsed lease, and this holder would overwrite it (two workers on one slot).
_RENEW = """
local current = redis.call('GET', KEYS[1])
if current == false or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLease:
    """At most one live holder of `key`: a Redis key with a TTL, renewed by its holder.
    Renew and release are Lua scripts, atomic on the server."""

    def __init__(self, *, key: str, holder: str, ttl_s: float | None = None) -> None:
        self.key = key
        self.holder = holder
        self.ttl_s = int(max(1, round(ttl_s or settings.DARTBOARD_LEASE_TTL_S)))
        self.redis = redis_client()
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)

    def _current(self) -> bytes | None:
        # Without decode_responses the client answers bytes; redis types `get` for both modes.
        return cast("bytes | None", self.redis.get(self.key))

    def acquire(self) -> str | None:
        """None when acquired, else the name of the live holder. A lease left by a killed
        holder lapses within the TTL, so this waits that long before giving up (and rides
        out a Redis outage of up to DARTBOARD_REDIS_RETRY_S)."""
        deadline = time.monotonic() + self.ttl_s + 5
        while True:
            taken = redis_retry(
                lambda: self.redis.set(self.key, self.holder, nx=True, ex=self.ttl_s),
                what=f"taking lease {self.key}",
            )
            if taken:
                return None
            if self.renew():  # ours already (a re-delivered task of this holder)
                return None
            current = self._current()
            if time.monotonic() > deadline:
                return current.decode() if current else "another worker"
            time.sleep(1.0)

    def renew(self) -> bool:
        """Extend the lease (taking it again if it lapsed and nobody took it); False when
        another holder has it (this one stalled past the TTL)."""
        return bool(self._renew(keys=[self.key], args=[self.holder, self.ttl_s]))

    def release(self) -> None:
        """Give the lease up if it is still ours, and close the connection. With Redis away
        the lease is left to lapse by its TTL."""
        try:
            self._release(keys=[self.key], args=[self.holder])
        except REDIS_DOWN as exc:
            log.warning(
                "lease %s not released (Redis unreachable: %s); it lapses in %d s",
                self.key,
                exc,
                self.ttl_s,
            )
        finally:
            self.redis.close()


def leases_renew(client: Any, leases: dict[str, str], *, ttl_s: float | None = None) -> set[str]:
    """Renew many leases (key -> holder) in one Redis round trip, each with the same atomic
    check-and-set as `RedisLease.renew`. Returns the keys another holder has (lost).

    For a process that holds many slot leases (bench/scale.py): a pipeline per period
    instead of one round trip, and one connection, per lease."""
    if not leases:
        return set()
    ttl = int(max(1, round(ttl_s or settings.DARTBOARD_LEASE_TTL_S)))
    renew = client.register_script(_RENEW)
    pipe = client.pipeline(transaction=False)
    keys = list(leases)
    for key in keys:
        renew(keys=[key], args=[leases[key], ttl], client=pipe)
    return {key for key, ok in zip(keys, pipe.execute(), strict=True) if not ok}


class LeaseKeeper(threading.Thread):
    """Renews a lease every third of its TTL until stopped; sets `lost` if another holder
    took it (the caller must then stop: two trainers of one run would publish clashing
    versions)."""

    def __init__(self, lease: RedisLease) -> None:
        super().__init__(daemon=True, name=f"lease-{lease.key}")
        self.lease = lease
        self.lost = threading.Event()
        self.stop_event = threading.Event()

    def run(self) -> None:
        failing = False
        while not self.stop_event.wait(self.lease.ttl_s / 3):
            try:
                if not self.lease.renew():
                    log.error("lease %s was taken over by another holder", self.lease.key)
                    self.lost.set()
                    return
                if failing:
                    log.warning("lease %s: renewed again, Redis is back", self.lease.key)
                failing = False
            except REDIS_DOWN as exc:  # Redis away: try again next period, say it once
                if not failing:
                    log.warning("lease %s: renewal failed (%s); retrying", self.lease.key, exc)
                failing = True

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)

    def finish(self) -> None:
        """Stop renewing and give the lease up (if it is still ours)."""
        self.stop()
        self.lease.release()


def work_hold(work: LiveWork, *, holder: str) -> LeaseKeeper | str:
    """Called by a task as it starts its live work: clear the pending marker and take the
    work's lease. Returns the running keeper (the caller ends with `keeper.finish()`), or
    the name of the live worker that holds it (the caller then ends at once)."""
    work_started(work)
    lease = RedisLease(key=work.lease_key, holder=holder)
    other = lease.acquire()
    if other is not None:
        lease.release()  # not ours: closes the connection only
        return other
    keeper = LeaseKeeper(lease)
    keeper.start()
    return keeper
