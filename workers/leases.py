"""Live work and its leases: an env slot or a run's trainer is a long-running Celery task that
at most one live worker holds at a time.

A lease is a Redis key with a TTL (settings.DARTBOARD_LEASE_TTL_S) that its holder renews; a
killed holder's lease lapses within the TTL. A pending marker is set when the work's task is
enqueued and cleared when a worker starts it, so the watchdog (workers/watchdog.py) can
tell work that is waiting in a queue from work whose worker died, and re-enqueues only the
latter.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

from celery import current_app as celery_app
from django.conf import settings

log = logging.getLogger("dartboard.leases")


def redis_client() -> Any:
    import redis

    return redis.Redis.from_url(settings.REDIS_URL)


@dataclass(frozen=True)
class LiveWork:
    """One piece of live work: what to call it, its lease, and the task that does it."""

    label: str  # "slot miniwob:0" or "trainer": for messages on the run
    lease_key: str
    task: str
    args: tuple[Any, ...]
    queue: str

    @property
    def pending_key(self) -> str:
        return f"{self.lease_key}:pending"


def slot_work(*, run_id: int, backend: str, index: int) -> LiveWork:
    return LiveWork(
        label=f"slot {backend}:{index}",
        lease_key=f"dartboard:slot-lease:{run_id}:{backend}:{index}",
        task="workers.tasks.slot_serve",
        args=(run_id, backend, index),
        queue="env",
    )


def trainer_work(*, run_id: int, mode: str) -> LiveWork:
    """The run's trainer: `train_run` (decoupled) or the synchronous baseline's `sync_run`."""
    task = "workers.tasks.sync_run" if mode == "synchronous" else "workers.tasks.train_run"
    return LiveWork(
        label="trainer",
        lease_key=f"dartboard:trainer-lease:{run_id}",
        task=task,
        args=(run_id,),
        queue="train",
    )


def eval_shard_work(*, job_id: int, shard: int, shards: int) -> LiveWork:
    """One env slot's share of a scheduled evaluation job."""
    return LiveWork(
        label=f"evaluation #{job_id} shard {shard + 1}/{shards}",
        lease_key=f"dartboard:eval-lease:{job_id}:{shard}",
        task="workers.tasks.eval_shard",
        args=(job_id, shard, shards),
        queue="env",
    )


def work_enqueue(work: LiveWork, *, countdown: float | None = None) -> None:
    """Mark `work` pending, then send its task (by name: the env cluster and the trainer may
    live in other code bases' workers)."""
    client = redis_client()
    try:
        # As long as the broker's visibility timeout: a message lost from the queue is given
        # up for (and the work enqueued again by the watchdog) when the broker would have.
        pending_ttl_s = settings.CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"]
        client.set(work.pending_key, str(time.time()), ex=pending_ttl_s)
    finally:
        client.close()
    celery_app.send_task(work.task, args=work.args, queue=work.queue, countdown=countdown)


def work_started(work: LiveWork) -> None:
    """Called by the task as it starts: its message has left the queue."""
    client = redis_client()
    try:
        client.delete(work.pending_key)
    finally:
        client.close()


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
        holder lapses within the TTL, so this waits that long before giving up."""
        deadline = time.monotonic() + self.ttl_s + 5
        while True:
            if self.redis.set(self.key, self.holder, nx=True, ex=self.ttl_s):
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
        """Give the lease up if it is still ours, and close the connection."""
        self._release(keys=[self.key], args=[self.holder])
        self.redis.close()


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
        while not self.stop_event.wait(self.lease.ttl_s / 3):
            try:
                if not self.lease.renew():
                    log.error("lease %s was taken over by another holder", self.lease.key)
                    self.lost.set()
                    return
            except Exception:  # Redis away for a moment: try again next period
                log.exception("lease %s: renewal failed", self.lease.key)

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
