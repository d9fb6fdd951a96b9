"""Celery tasks of the data manager (the trainer runs on queue `train`)."""

import logging
from collections.abc import Callable

from celery import shared_task

from datamanager.leases import (
    LeaseKeeper,
    RedisLease,
    holder_name,
    trainer_work,
    work_enqueue,
    work_started,
)
from datamanager.training_loop import train_for, trainer_forget

SLICE_SECONDS = 600.0
RETRY_SECONDS = 30.0

log = logging.getLogger("dartboard.trainer")


def _drive(loop: Callable[..., str], *, run_id: int, mode: str) -> str:
    """Run one time slice of a run's trainer loop and re-enqueue its task for the next.

    One live trainer per run: the slice holds the run's trainer lease (a duplicate task finds
    it held and ends; a killed trainer's lease lapses and the watchdog enqueues it again).
    A loop that raises must not stop silently while the run keeps rolling out: the run says
    what failed, the trainer held in memory (maybe half-updated) is dropped so the retry
    resumes from the last published checkpoint, and the retry comes RETRY_SECONDS later."""
    from datamanager.models import Run
    from datamanager.services import run_set_message

    work = trainer_work(run_id=run_id, mode=mode)
    work_started(work)
    lease = RedisLease(key=work.lease_key, holder=holder_name(f"trainer:{run_id}"))
    holder = lease.acquire()
    if holder is not None:
        lease.release()  # not ours: closes the connection only
        return f"the trainer of run {run_id} is held by {holder}"
    keeper = LeaseKeeper(lease)
    keeper.start()
    try:
        reason = loop(run_id=run_id, max_seconds=SLICE_SECONDS, stop=keeper.lost)
    except Exception as exc:
        log.exception("run %s: trainer failed", run_id)
        trainer_forget(run_id=run_id)
        if not Run.objects.filter(pk=run_id).exists():
            return "run deleted"
        run_set_message(
            run_id=run_id,
            message=f"trainer failed: {type(exc).__name__}: {exc}. Retrying in "
            f"{RETRY_SECONDS:.0f} s from the last published checkpoint; the train worker's "
            "log has the traceback.",
        )
        work_enqueue(work, countdown=RETRY_SECONDS)
        return f"failed: {type(exc).__name__}: {exc}"
    finally:
        keeper.stop()
        lease.release()
    if keeper.lost.is_set():
        # Another worker holds this run's trainer now; this one's weights are not trusted.
        trainer_forget(run_id=run_id)
        return "trainer lease lost to another worker"
    if reason == "time slice over":
        work_enqueue(work)
    return reason


@shared_task(name="datamanager.tasks.train_run", acks_late=True)
def train_run(run_id: int) -> str:
    return _drive(train_for, run_id=run_id, mode="decoupled")


@shared_task(name="datamanager.tasks.sync_run", acks_late=True)
def sync_run(run_id: int) -> str:
    """The synchronous baseline's driver (queue `train`)."""
    from datamanager.sync_loop import sync_for

    return _drive(sync_for, run_id=run_id, mode="synchronous")


@shared_task(name="datamanager.tasks.runs_watchdog", ignore_result=True)
def runs_watchdog() -> list[str]:
    """Celery beat calls this every DARTBOARD_WATCHDOG_PERIOD_S (queue default)."""
    from datamanager.watchdog import watchdog_pass

    return watchdog_pass()
