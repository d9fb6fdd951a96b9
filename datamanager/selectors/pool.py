"""The experience pool: which trajectories are in it, one definition for every reader (the
group joins, the trainer's demo batches, the pool sizes on the task board).

A trajectory is in its task's pool when a curator or the oracle put it there (`in_pool`)
and it is not rejected (a rejection takes it out, and so does a screenshot lost from
storage).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from django.db.models import Count, QuerySet

from datamanager.models import Trajectory


def pool_members(**filters: Any) -> QuerySet[Trajectory]:
    """The pool's trajectories (`filters` narrow them: task_id=..., task_id__in=...)."""
    return Trajectory.objects.filter(in_pool=True, rejected=False, **filters)


def pool_sizes(*, task_ids: Collection[int]) -> dict[int, int]:
    """Pool trajectories per task, every task of `task_ids` included (0 for an empty pool)."""
    counts = dict(
        pool_members(task_id__in=list(task_ids))
        .values("task_id")
        .annotate(n=Count("pk"))
        .values_list("task_id", "n")
    )
    return {task_id: counts.get(task_id, 0) for task_id in task_ids}
