"""Reads from the data manager's tables."""

from __future__ import annotations

from datamanager.config import TaskSelection
from datamanager.models import Task


def task_list(*, selection: TaskSelection) -> list[Task]:
    """Tasks of a selection. Tags are filtered here (JSON list; a few hundred tasks at most)."""
    qs = Task.objects.filter(split=selection.split, env_kind__in=selection.env_kinds)
    if selection.names:
        qs = qs.filter(name__in=selection.names)
    wanted = set(selection.tags)
    return [t for t in qs if wanted.issubset(t.tags)]
