"""Storing pre-collected successful trajectories (oracle demos) in the experience pool."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from core.imaging import ImageGeometry
from datamanager.models import Step, Task, TaskStat, Trajectory, TrajectorySource, TrajectoryStatus
from datamanager.selectors.pool import pool_members, pool_sizes
from datamanager.services.step_rows import step_row
from rollout.episode import StepRecord


@dataclass(frozen=True)
class DemoStep:
    screenshot_png: bytes
    width: int
    height: int
    raw_output: str
    thought: str
    action: dict[str, Any]


@transaction.atomic
def demo_store(
    *,
    task: Task,
    instruction: str,
    steps: list[DemoStep],
    reward: float,
    source: str = TrajectorySource.PRECOLLECTED,
    in_pool: bool = True,
    geometry: ImageGeometry | None = None,
) -> Trajectory:
    """One successful trajectory with its steps, in the task's experience pool. `geometry`
    is the image geometry its model coordinates were written in (oracle demos)."""
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
    for i, s in enumerate(steps):
        demo_step_store(
            trajectory=traj,
            index=i,
            step=s,
            path=f"demos/task-{task.pk}/traj-{traj.pk}/{i:03d}.png",
        )
    pool_refresh(task_ids=[task.pk])
    return traj


def demo_step_store(*, trajectory: Trajectory, index: int, step: DemoStep, path: str) -> Step:
    """One pre-collected step with its screenshot saved under `path` in media storage."""
    record = StepRecord(
        index=index,
        screenshot_png=step.screenshot_png,
        width=step.width,
        height=step.height,
        raw_output=step.raw_output,
        thought=step.thought,
        action=step.action,
        parse_error="",
        prompt_tokens=0,
        response_tokens=0,
        rollout_logprobs=[],
        response_token_ids=[],
        mean_entropy=None,
        policy_version=None,
        env_ms=None,
        model_ms=None,
    )
    row = step_row(trajectory_id=trajectory.pk, record=record, screenshot_name=path)
    try:
        row.save()
    except BaseException:
        if row.screenshot.name:  # no screenshot without its row
            row.screenshot.storage.delete(row.screenshot.name)
        raise
    return row


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
