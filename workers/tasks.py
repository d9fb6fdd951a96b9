"""Celery tasks: thin interfaces over the worker loops. Each takes ids and owns its re-enqueue.

Queues (routes in settings): `env` (slot_serve, episode_once, eval_shard: env slots running
episodes), `train` (train_run, sync_run: one trainer task per run), `default` (the watchdog,
sweeps_advance, dataset_export, ping). Workers: `celery -A dartboard worker -Q env|train|default`.
"""

import logging
import socket
from typing import Any

from celery import shared_task

from datamanager.live_work import REDIS_DOWN, slot_work, work_enqueue
from datamanager.services import sweeps
from datamanager.services.datasets import dataset_export_run
from workers.dbutil import is_outage
from workers.evaluation import eval_shard_serve
from workers.leases import work_started
from workers.lifecycle import shutdown_requested
from workers.slot_worker import serve_lockstep_episode, serve_slice
from workers.watchdog import watchdog_pass

SLOT_SLICE_SECONDS = 300.0  # a slot task re-enqueues itself: no task stays unacked for long

log = logging.getLogger("dartboard.tasks")


@shared_task(name="workers.tasks.slot_serve", acks_late=True)
def slot_serve(run_id: int, backend: str, index: int) -> str:
    work = slot_work(run_id=run_id, backend=backend, index=index)
    work_started(work)
    while True:
        outcome = serve_slice(
            run_id=run_id, backend=backend, index=index, max_seconds=SLOT_SLICE_SECONDS
        )
        if not outcome.keep_going:
            return outcome.reason
        try:
            work_enqueue(work)
            return outcome.reason
        except REDIS_DOWN as exc:
            if shutdown_requested.is_set():
                log.warning(
                    "slot %s: not re-enqueued (%s); the watchdog brings it back", work.label, exc
                )
                return outcome.reason
            # The broker is away: serve another slice here rather than drop the slot.
            log.warning(
                "slot %s: could not enqueue its next slice (%s); serving it in this task",
                work.label,
                exc,
            )


@shared_task(name="workers.tasks.episode_once", acks_late=True)
def episode_once(
    run_id: int, backend: str, index: int, lockstep: dict[str, Any] | None = None
) -> str:
    """One episode of the synchronous baseline's round on this slot."""
    return serve_lockstep_episode(run_id=run_id, backend=backend, index=index, lockstep=lockstep)


@shared_task(name="workers.tasks.eval_shard", acks_late=True)
def eval_shard(job_id: int, shard: int, shards: int) -> str:
    """One env slot's share of an evaluation job."""
    return eval_shard_serve(job_id=job_id, shard=shard, shards=shards)


@shared_task(name="workers.tasks.train_run", acks_late=True)
def train_run(run_id: int) -> str:
    from workers.training_loop import train_for, trainer_drive  # the trainer's imports (torch,
    # transformers, peft: seconds of CPU) are paid by the train queue's worker only

    return trainer_drive(train_for, run_id=run_id, mode="decoupled")


@shared_task(name="workers.tasks.sync_run", acks_late=True)
def sync_run(run_id: int) -> str:
    """The synchronous baseline's driver (queue `train`)."""
    # The trainer's imports (torch, transformers, peft: seconds of CPU) are paid by the
    # train queue's worker only, as in train_run.
    from workers.sync_loop import sync_for
    from workers.training_loop import trainer_drive

    return trainer_drive(sync_for, run_id=run_id, mode="synchronous")


@shared_task(name="workers.tasks.runs_watchdog", ignore_result=True)
def runs_watchdog() -> list[str]:
    """Celery beat calls this every DARTBOARD_WATCHDOG_PERIOD_S (queue default). While the
    database or Redis is away there is nothing it could do: one line says so."""
    try:
        return watchdog_pass()
    except Exception as exc:
        if not is_outage(exc):
            raise
        log.warning(
            "watchdog pass skipped, %s unreachable: %s: %s",
            "Redis" if isinstance(exc, REDIS_DOWN) else "the database",
            type(exc).__name__,
            str(exc).strip().splitlines()[0],
        )
        return []


@shared_task(name="workers.tasks.sweeps_advance", ignore_result=True)
def sweeps_advance() -> list[int]:
    """Celery beat calls this every DARTBOARD_WATCHDOG_PERIOD_S (queue default): each
    sweep's next members start as earlier ones end (datamanager/services/sweeps.py)."""
    try:
        return sweeps.sweeps_advance()
    except Exception as exc:
        if not is_outage(exc):
            raise
        log.warning("sweeps not advanced, the database is unreachable: %s", exc)
        return []


@shared_task(name="workers.tasks.ping")
def ping() -> dict[str, str]:
    """Round trip through the broker; tells which host answered."""
    return {"pong": socket.gethostname()}


@shared_task(name="workers.tasks.dataset_export", acks_late=True)
def dataset_export(export_id: int) -> str:
    """Write a dataset export into the media storage (queue default); `dataset_export_create`
    enqueues it by name."""
    export = dataset_export_run(export_id=export_id)
    return f"export {export_id}: {export.status}"
