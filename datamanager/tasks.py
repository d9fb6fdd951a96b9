"""Celery tasks of the data manager (the trainer runs on queue `train`)."""

import logging

from celery import shared_task

from datamanager.training_loop import train_for, trainer_forget

SLICE_SECONDS = 600.0
RETRY_SECONDS = 30.0

log = logging.getLogger("dartboard.trainer")


def _report_failure(*, run_id: int, what: str, exc: Exception) -> None:
    """Say on the run that its trainer failed and when it retries (never a silent stop)."""
    from datamanager.services import run_set_message

    log.exception("run %s: %s failed", run_id, what)
    run_set_message(
        run_id=run_id,
        message=f"{what} failed: {type(exc).__name__}: {exc}. Retrying in {RETRY_SECONDS:.0f} s "
        "from the last published checkpoint; the train worker's log has the traceback.",
    )


@shared_task(name="datamanager.tasks.train_run", acks_late=True)
def train_run(run_id: int) -> str:
    try:
        reason = train_for(run_id=run_id, max_seconds=SLICE_SECONDS)
    except Exception as exc:
        # The weights held in memory may be half-updated: the retry reloads the checkpoint.
        trainer_forget(run_id=run_id)
        _report_failure(run_id=run_id, what="trainer", exc=exc)
        train_run.apply_async(args=(run_id,), queue="train", countdown=RETRY_SECONDS)
        return f"failed: {type(exc).__name__}: {exc}"
    if reason == "time slice over":
        train_run.apply_async(args=(run_id,), queue="train")
    return reason


@shared_task(name="datamanager.tasks.sync_run", acks_late=True)
def sync_run(run_id: int) -> str:
    """The synchronous baseline's driver (queue `train`)."""
    from datamanager.sync_loop import sync_for

    reason = sync_for(run_id=run_id, max_seconds=SLICE_SECONDS)
    if reason == "time slice over":
        sync_run.apply_async(args=(run_id,), queue="train")
    return reason
