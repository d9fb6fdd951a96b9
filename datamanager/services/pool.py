"""Storing pre-collected successful trajectories (oracle demos) in the experience pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.core.files.base import ContentFile
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from datamanager.models import Step, Task, TaskStat, Trajectory


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
    source: str = "precollected",
    in_pool: bool = True,
) -> Trajectory:
    """One successful trajectory with its steps, in the task's experience pool."""
    now = timezone.now()
    traj = Trajectory.objects.create(
        task=task,
        status="succeeded" if reward > 0 else "failed",
        reward=reward,
        length=len(steps),
        source=source,
        in_pool=in_pool,
        instruction=instruction,
        finished_at=now,
    )
    for i, s in enumerate(steps):
        step = Step(
            trajectory=traj,
            index=i,
            screen_width=s.width,
            screen_height=s.height,
            raw_output=s.raw_output,
            thought=s.thought,
            action=s.action,
        )
        step.screenshot.save(
            f"demos/task-{task.pk}/traj-{traj.pk}/{i:03d}.png",
            ContentFile(s.screenshot_png),
            save=False,
        )
        step.save()
    pool_refresh(task_ids=[task.pk])
    return traj


def pool_refresh(*, task_ids: list[int]) -> None:
    """Recompute TaskStat.pool_size for these tasks (every run)."""
    counts = dict(
        Task.objects.filter(pk__in=task_ids)
        .annotate(n=Count("trajectories", filter=Q(trajectories__in_pool=True)))
        .values_list("pk", "n")
    )
    for task_id, n in counts.items():
        TaskStat.objects.filter(task_id=task_id).update(pool_size=n)


def pool_count(*, task: Task) -> int:
    return Trajectory.objects.filter(task=task, in_pool=True).count()
