"""Reads from the data manager's tables."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db.models import QuerySet

from datamanager.config import TaskSelection
from datamanager.models import EnvKind, Task
from datamanager.policies import EvalSetupError
from envmanager.osworld_file_cache import FileCache, task_urls
from envmanager.osworld_needs import lacking, recorded_needs


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


@dataclass(frozen=True)
class OSWorldPlacement:
    """Whether an OSWorld task can run on a run's VMs: what it needs that they lack, and the
    URLs of its files the file cache lacks (both empty: it can)."""

    task: str
    lacks: list[str]
    missing_files: list[str]


def osworld_task_needs(task: Task) -> list[str]:
    """What an osworld task needs of its slot; [] for a task of another kind."""
    return recorded_needs(task.env_config) if task.env_kind == EnvKind.OSWORLD else []


def osworld_task_missing_files(task: Task, cache: FileCache | None = None) -> list[str]:
    """The URLs of an osworld task's files that `cache` (this host's) lacks."""
    spec = task.env_config.get("osworld")
    if task.env_kind != EnvKind.OSWORLD or not isinstance(spec, dict):
        return []
    return (cache or FileCache(settings.OSWORLD_FILE_CACHE)).missing(task_urls(spec))


def osworld_placements(
    *, tasks: list[Task], offers: list[str], cache: FileCache
) -> list[OSWorldPlacement]:
    """For each osworld task of `tasks`, what keeps it off VMs offering `offers` with this
    host's file cache `cache`."""
    return [
        OSWorldPlacement(
            task=task.name,
            lacks=lacking(osworld_task_needs(task), offers),
            missing_files=osworld_task_missing_files(task, cache),
        )
        for task in tasks
        if task.env_kind == EnvKind.OSWORLD
    ]
