"""Celery tasks of the data manager (the trainer runs on queue `train`)."""

from celery import shared_task

from datamanager.training_loop import train_for

SLICE_SECONDS = 600.0


@shared_task(name="datamanager.tasks.train_run", acks_late=True)
def train_run(run_id: int) -> str:
    reason = train_for(run_id=run_id, max_seconds=SLICE_SECONDS)
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
