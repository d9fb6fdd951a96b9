"""Live work and its leases: an env slot or a run's trainer is a long-running Celery task that
at most one live worker holds at a time.

A lease is a Redis key with a TTL (settings.DARTBOARD_LEASE_TTL_S) that its holder renews; a
killed holder's lease lapses within the TTL. A pending marker is set when the work's task is
enqueued and cleared when a worker starts it, so the watchdog (workers/watchdog.py) can
tell work that is waiting in a queue from work whose worker died, and re-enqueues only the
latter. The watchdog also looks for the message itself in the broker's queue (`QueuedTasks`):
a marker whose message is gone (a Redis restart without its data, a message stranded with a
dead connection) is lost work, not waiting work.

Redis outages: every client here retries a failed command with backoff for a few seconds
(`redis_client`); `work_enqueue` keeps trying for DARTBOARD_REDIS_RETRY_S; a lease keeper
rides out an outage and takes its lease again when Redis is back, unless another holder took
it meanwhile (then it says so and its holder stops).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis
from celery import current_app as celery_app
from django.conf import settings
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from datamanager.models import EvalJob, PlacementState, RunPlacement

log = logging.getLogger("dartboard.leases")

T = TypeVar("T")

# What an unreachable broker raises: redis-py's own errors, and kombu's wrapper of them
# when Celery publishes a task.
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
              KombuOperationalError)  # fmt: skip


def redis_client(*, blocking_pool: int = 0) -> Any:
    """A client that retries a command on a dropped connection (3 times, backoff up to 1 s):
    enough for a restart on the same socket; longer outages reach the caller.

    blocking_pool: for a client many threads share, at most this many connections, and a
    thread waits (up to 30 s) for a free one instead of failing; 0: redis-py's own pool."""
    options: dict[str, Any] = {
        "socket_connect_timeout": 3,
        "socket_timeout": 10,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.1), retries=3),
        "retry_on_error": [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        "health_check_interval": 10,
    }
    if blocking_pool:
        pool = redis.BlockingConnectionPool.from_url(
            settings.REDIS_URL, max_connections=blocking_pool, timeout=30, **options
        )
        return redis.Redis(connection_pool=pool)
    return redis.Redis.from_url(settings.REDIS_URL, **options)


def redis_retry(fn: Callable[[], T], *, what: str, budget_s: float | None = None) -> T:
    """Call `fn` until Redis answers, with backoff up to 5 s, for at most `budget_s`
    (settings.DARTBOARD_REDIS_RETRY_S); then the last error is raised."""
    budget = settings.DARTBOARD_REDIS_RETRY_S if budget_s is None else budget_s
    deadline = time.monotonic() + budget
    delay = 0.2
    while True:
        try:
            return fn()
        except REDIS_DOWN as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("Redis unreachable while %s (%s); retrying in %.1f s", what, exc, delay)
            time.sleep(delay)
            delay = min(5.0, delay * 2)


@dataclass(frozen=True)
class LiveWork:
    """One piece of live work: what to call it, its lease, and the task that does it."""

    label: str  # "slot miniwob:0" or "trainer": for messages on the run
    lease_key: str
    task: str
    args: tuple[Any, ...]
    kind: str  # "env" or "train": which workers serve it
    run_id: int | None = None  # the run it serves, if known
    eval_job: int | None = None  # an evaluation shard's job (its run is looked up)

    @property
    def pending_key(self) -> str:
        return f"{self.lease_key}:pending"

    @functools.cached_property
    def queue(self) -> str:
        """Its Celery queue, looked up when first asked (the database may be away when the
        work is only named, for its lease key), then kept."""
        run_id = self.run_id
        if self.eval_job is not None:
            run_id = (
                EvalJob.objects.filter(pk=self.eval_job).values_list("run_id", flat=True).first()
            )
        return self.kind if run_id is None else run_queue(run_id=run_id, kind=self.kind)


def run_queue(*, run_id: int, kind: str) -> str:
    """The Celery queue of a run's `kind` ("env" or "train") work: the run's own
    (`env.run7`), served by the workers a host agent started for it, when it has a live
    placement; else the shared one every launcher's workers serve."""
    live = RunPlacement.objects.filter(run_id=run_id).exclude(state=PlacementState.ENDED)
    return f"{kind}.run{run_id}" if live.exists() else kind


def slot_work(*, run_id: int, backend: str, index: int) -> LiveWork:
    return LiveWork(
        label=f"slot {backend}:{index}",
        lease_key=f"dartboard:slot-lease:{run_id}:{backend}:{index}",
        task="workers.tasks.slot_serve",
        args=(run_id, backend, index),
        kind="env",
        run_id=run_id,
    )


def trainer_work(*, run_id: int, mode: str) -> LiveWork:
    """The run's trainer: `train_run` (decoupled) or the synchronous baseline's `sync_run`."""
    task = "workers.tasks.sync_run" if mode == "synchronous" else "workers.tasks.train_run"
    return LiveWork(
        label="trainer",
        lease_key=f"dartboard:trainer-lease:{run_id}",
        task=task,
        args=(run_id,),
        kind="train",
        run_id=run_id,
    )


def eval_shard_work(*, job_id: int, shard: int, shards: int) -> LiveWork:
    """One env slot's share of a scheduled evaluation job."""
    return LiveWork(
        label=f"evaluation #{job_id} shard {shard + 1}/{shards}",
        lease_key=f"dartboard:eval-lease:{job_id}:{shard}",
        task="workers.tasks.eval_shard",
        args=(job_id, shard, shards),
        kind="env",
        eval_job=job_id,
    )


def work_enqueue(work: LiveWork, *, countdown: float | None = None) -> None:
    """Mark `work` pending, then send its task (by name: the env cluster and the trainer may
    live in other code bases' workers). Rides out a Redis outage of up to
    DARTBOARD_REDIS_RETRY_S; past that the error is raised (and the watchdog brings the work
    back once Redis is up)."""

    def enqueue() -> None:
        client = redis_client()
        try:
            # The marker holds when the task is due: a task sent with a countdown sits with a
            # worker until then, not in the queue, and is not lost meanwhile.
            due = time.time() + (countdown or 0.0)
            pending_ttl_s = settings.CELERY_BROKER_TRANSPORT_OPTIONS["visibility_timeout"]
            client.set(work.pending_key, str(due), ex=pending_ttl_s)
        finally:
            client.close()
        celery_app.send_task(work.task, args=work.args, queue=queue, countdown=countdown)

    queue = work.queue  # before the retries: the database is not asked inside them
    redis_retry(enqueue, what=f"enqueueing the {work.label}")


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
            log.warning("lease %s not released (Redis unreachable: %s); it lapses in %d s",
                        self.key, exc, self.ttl_s)  # fmt: skip
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
