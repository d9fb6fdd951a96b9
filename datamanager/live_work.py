"""Live work, named and enqueued: an env slot, a run's trainer or a scheduled evaluation's
shard is a long-running Celery task (`LiveWork`: its label, its lease key, its task and its
queue), sent by name (`work_enqueue`), so the services that start it import no worker code.

A pending marker is set when the work's task is enqueued and cleared when a worker starts
it; the worker then holds the work's lease (workers/leases.py), and the watchdog
(workers/watchdog.py) tells work waiting in a queue from work whose worker died by them.

Redis outages: every client here retries a failed command with backoff for a few seconds
(`redis_client`); `work_enqueue` keeps trying for DARTBOARD_REDIS_RETRY_S.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from celery import current_app as celery_app
from django.conf import settings
from kombu.exceptions import OperationalError as KombuOperationalError
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from datamanager.config import RunConfig
from datamanager.models import EvalJob, PlacementState, RunPlacement
from datamanager.policies import ORACLE_POLICY

log = logging.getLogger("dartboard.leases")

T = TypeVar("T")

# What an unreachable broker raises: redis-py's own errors, and kombu's wrapper of them
# when Celery publishes a task.
REDIS_DOWN = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    KombuOperationalError,
)


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


def run_live_work(*, run_id: int, cfg: RunConfig) -> list[LiveWork]:
    """The long-running tasks a running run needs: one per env slot (decoupled; a synchronous
    run's driver hands out its slots' episodes itself) and its trainer (none for the scripted
    oracle, which has nothing to train)."""
    if cfg.mode == "synchronous":
        return [trainer_work(run_id=run_id, mode=cfg.mode)]
    work = [slot_work(run_id=run_id, backend=b, index=i) for b, i in cfg.env.slots()]
    if cfg.policy != ORACLE_POLICY:
        work.append(trainer_work(run_id=run_id, mode=cfg.mode))
    return work


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
