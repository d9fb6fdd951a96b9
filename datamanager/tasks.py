"""Celery tasks of the data manager (the trainer runs on queue `train`)."""

import logging
from collections.abc import Callable

from celery import Task, shared_task

from datamanager.training_loop import train_for, trainer_forget

SLICE_SECONDS = 600.0
RETRY_SECONDS = 30.0

log = logging.getLogger("dartboard.trainer")


def _drive(task: Task, loop: Callable[..., str], *, run_id: int) -> str:
    """Run one time slice of a run's trainer loop and re-enqueue `task` for the next.

    A loop that raises must not stop silently while the run keeps rolling out: the run says
    what failed, the trainer held in memory (maybe half-updated) is dropped so the retry
    resumes from the last published checkpoint, and the retry comes RETRY_SECONDS later."""
    from datamanager.models import Run
    from datamanager.services import run_set_message

    try:
        reason = loop(run_id=run_id, max_seconds=SLICE_SECONDS)
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
        task.apply_async(args=(run_id,), queue="train", countdown=RETRY_SECONDS)
        return f"failed: {type(exc).__name__}: {exc}"
    if reason == "time slice over":
        task.apply_async(args=(run_id,), queue="train")
    return reason


@shared_task(name="datamanager.tasks.train_run", acks_late=True)
def train_run(run_id: int) -> str:
    return _drive(train_run, train_for, run_id=run_id)


@shared_task(name="datamanager.tasks.sync_run", acks_late=True)
def sync_run(run_id: int) -> str:
    """The synchronous baseline's driver (queue `train`)."""
    from datamanager.sync_loop import sync_for

    return _drive(sync_run, sync_for, run_id=run_id)
