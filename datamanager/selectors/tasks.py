"""Reads from the data manager's tables."""

from __future__ import annotations

from django.db.models import QuerySet

from datamanager.config import TaskSelection
from datamanager.models import Task
from datamanager.policies import EvalSetupError


def task_list(*, selection: TaskSelection) -> list[Task]:
    """Tasks of a selection. Tags are filtered here (JSON list; a few hundred tasks at most)."""
    qs = Task.objects.filter(split=selection.split, env_kind__in=selection.env_kinds)
    if selection.names:
        qs = qs.filter(name__in=selection.names)
    wanted = set(selection.tags)
    return [t for t in qs if wanted.issubset(t.tags)]


def tasks_select(*, spec: str) -> list[Task]:
    """'split:eval', 'tag:click' or a comma-separated list of task names."""
    if spec.startswith("split:"):
        tasks = list(Task.objects.filter(split=spec.removeprefix("split:")))
    elif spec.startswith("tag:"):
        tag = spec.removeprefix("tag:")
        tasks = [t for t in Task.objects.all() if tag in t.tags]
    else:
        names = [n for n in spec.split(",") if n]
        tasks = list(Task.objects.filter(name__in=names))
        missing = sorted(set(names) - {t.name for t in tasks})
        if missing:
            raise EvalSetupError(f"unknown task(s): {', '.join(missing)}")
    if not tasks:
        raise EvalSetupError(f"task selection {spec!r} matches no task")
    return sorted(tasks, key=lambda t: t.name)


def tasks_listing() -> QuerySet[Task]:
    """Every task, in the model's order (by name), for the API to filter and page."""
    return Task.objects.all()
