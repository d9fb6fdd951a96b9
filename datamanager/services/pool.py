"""Storing pre-collected successful trajectories (oracle demos) in the experience pool."""

from __future__ import annotations

from collections.abc import Collection

from django.db import transaction
from django.utils import timezone

from core.imaging import ImageGeometry
from core.steps import StepRecord
from datamanager.models import Task, TaskStat, Trajectory, TrajectorySource, TrajectoryStatus
from datamanager.selectors.pool import pool_members, pool_sizes
from datamanager.services.steps import StepWrite, TrajectoryHead, steps_store


@transaction.atomic
def demo_store(
    *,
    task: Task,
    instruction: str,
    steps: list[StepRecord],
    reward: float,
    source: str = TrajectorySource.PRECOLLECTED,
    in_pool: bool = True,
    geometry: ImageGeometry | None = None,
) -> Trajectory:
    """One successful trajectory with its steps (`StepRecord.demonstration`s), in the task's
    experience pool. `geometry` is the image geometry its model coordinates were written in
    (oracle demos)."""
    now = timezone.now()
    traj = Trajectory.objects.create(
        task=task,
        status=TrajectoryStatus.SUCCEEDED if reward > 0 else TrajectoryStatus.FAILED,
        reward=reward,
        length=len(steps),
        source=source,
        in_pool=in_pool,
        instruction=instruction,
        finished_at=now,
        details={"image_geometry": geometry.to_json()} if geometry is not None else {},
    )
    head = TrajectoryHead.of(traj, media_dir=f"demos/task-{task.pk}/traj-{traj.pk}")
    steps_store(writes=[StepWrite(head=head, record=s) for s in steps])
    pool_refresh(task_ids=[task.pk])
    return traj


def pool_refresh(*, task_ids: Collection[int]) -> None:
    """Recompute TaskStat.pool_size of these tasks, in every run that has them."""
    for task_id, n in pool_sizes(task_ids=task_ids).items():
        TaskStat.objects.filter(task_id=task_id).update(pool_size=n)


def pool_count(*, task: Task) -> int:
    return pool_members(task=task).count()


@transaction.atomic
def pool_retire_other_geometry(*, task: Task, geometry: ImageGeometry) -> int:
    """Take out of the pool the task's oracle demos written in another image geometry (or
    before demos recorded theirs): a warm start on them clones clicks in a coordinate space
    the policy never sees. They stay stored, out of the pool. Returns how many."""
    wanted = geometry.to_json()
    stale = [
        t.pk
        for t in pool_members(task=task, source=TrajectorySource.PRECOLLECTED)
        if t.details.get("image_geometry") != wanted
    ]
    Trajectory.objects.filter(pk__in=stale).update(in_pool=False)
    if stale:
        pool_refresh(task_ids=[task.pk])
    return len(stale)
