"""Celery tasks of the environment cluster (queue `env`)."""

from typing import Any

from celery import shared_task
from django.conf import settings

from datamanager.leases import slot_work, work_enqueue, work_started
from envmanager.lockstep import RedisLockstep
from envmanager.slots import serve_slot

SLICE_SECONDS = 300.0  # a slot task re-enqueues itself: no task stays unacked for long


@shared_task(name="envmanager.tasks.slot_serve", acks_late=True)
def slot_serve(run_id: int, backend: str, index: int) -> str:
    work = slot_work(run_id=run_id, backend=backend, index=index)
    work_started(work)
    outcome = serve_slot(run_id=run_id, backend=backend, index=index, max_seconds=SLICE_SECONDS)
    if outcome.keep_going:
        work_enqueue(work)
    return outcome.reason


@shared_task(name="envmanager.tasks.episode_once", acks_late=True)
def episode_once(
    run_id: int, backend: str, index: int, lockstep: dict[str, Any] | None = None
) -> str:
    """One episode on this slot (the synchronous baseline's rollout phase). `lockstep`
    ({"key", "members", "timeout_s"}) paces it turn by turn with the round's other slots
    (envmanager.lockstep); this slot leaves the round however its episode ends."""
    pacer = None
    if lockstep is not None:
        pacer = RedisLockstep(
            redis_url=settings.REDIS_URL,
            key=lockstep["key"],
            members=int(lockstep["members"]),
            timeout_s=float(lockstep["timeout_s"]),
        )
    try:
        reason = serve_slot(
            run_id=run_id,
            backend=backend,
            index=index,
            max_seconds=3600,
            max_episodes=1,
            pacer=pacer,
        ).reason
    finally:
        if pacer is not None:
            pacer.leave()
    if pacer is not None and pacer.broken:
        # Not only in this worker's log: the run says its batch loop lost a member.
        from datamanager.services import run_set_message

        run_set_message(
            run_id=run_id,
            message=f"synchronous round: slot {backend}:{index} waited "
            f"{pacer.timeout_s:.0f} s for a member of its round that never arrived (a dead "
            "env worker?); the round went on without it",
        )
    return reason


@shared_task(name="envmanager.tasks.eval_shard", acks_late=True)
def eval_shard(job_id: int, shard: int, shards: int) -> str:
    """One env slot's share of an evaluation job."""
    from envmanager.evaluate import eval_job_run

    job = eval_job_run(job_id=job_id, shard=shard, shards=shards)
    return f"eval #{job_id} shard {shard}/{shards}: {job.done}/{job.total}"
