"""Writes to the data manager's tables. Keyword-only functions named `<entity>_<action>`."""

from __future__ import annotations

from collections.abc import Iterable

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import Run, RunAction, RunStatus, Task
from datamanager.task_import import TaskRecord


class InvalidTransition(ValueError):
    """A run control action is not allowed in the run's current status."""


@transaction.atomic
def tasks_import(*, records: Iterable[TaskRecord]) -> tuple[int, int]:
    """Create or update tasks by name, all in one transaction. Returns (created, updated)."""
    created = updated = 0
    for rec in records:
        _, was_created = Task.objects.update_or_create(
            name=rec.name,
            defaults={
                "env_kind": rec.env_kind,
                "env_config": rec.env_config,
                "instruction": rec.instruction,
                "split": rec.split,
                "tags": list(rec.tags),
            },
        )
        created += was_created
        updated += not was_created
    return created, updated


def run_create(*, name: str, config: RunConfig, owner: User | None = None) -> Run:
    """Store a run with its resolved config (every default filled in)."""
    return Run.objects.create(name=name, config=config.to_dict(), owner=owner)


_TRANSITIONS = {
    "start": ({RunStatus.CREATED, RunStatus.STOPPED, RunStatus.FAILED}, RunStatus.RUNNING),
    "pause": ({RunStatus.RUNNING}, RunStatus.PAUSED),
    "resume": ({RunStatus.PAUSED}, RunStatus.RUNNING),
    "stop": (
        {RunStatus.RUNNING, RunStatus.PAUSED, RunStatus.CREATED, RunStatus.QUEUED},
        RunStatus.STOPPED,
    ),
}


@transaction.atomic
def run_control(*, run_id: int, action: str, queue: bool = False) -> Run:
    """Start, pause, resume or stop a run; raise InvalidTransition with the reason.
    `queue`: a start waits as QUEUED for a host agent to bring up its processes
    (`run_begin` then makes it RUNNING)."""
    if action not in _TRANSITIONS:
        raise InvalidTransition(f"unknown action {action!r}; use start, pause, resume or stop")
    run = Run.objects.select_for_update(of=("self",)).get(pk=run_id)
    allowed, target = _TRANSITIONS[action]
    if run.status not in allowed:
        raise InvalidTransition(f"cannot {action} a run that is {run.status}")
    if action == "start" and queue:
        target = RunStatus.QUEUED
    run.status = target
    now = timezone.now()
    if action == "start":
        run.started_at = run.started_at or now
        run.finished_at = None
    if action == "stop":
        run.finished_at = now
    run.status_message = ""
    run.save(update_fields=["status", "started_at", "finished_at", "status_message", "updated_at"])
    return run


@transaction.atomic
def run_begin(*, run_id: int) -> bool:
    """A queued run whose processes are up becomes RUNNING. False if it is no longer queued
    (stopped while it waited)."""
    run = Run.objects.select_for_update(of=("self",)).get(pk=run_id)
    if run.status != RunStatus.QUEUED:
        return False
    run.status = RunStatus.RUNNING
    run.status_message = ""
    run.save(update_fields=["status", "status_message", "updated_at"])
    return True


def run_fail_queued(*, run_id: int, message: str) -> None:
    """A queued run that cannot start (its policy is gone, say) fails, saying why."""
    Run.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
        status=RunStatus.FAILED, finished_at=timezone.now()
    )
    run_set_message(run_id=run_id, message=message)


def run_action_record(*, run_id: int, action: str, user: User | None, outcome: str) -> None:
    """Audit a run control attempt: who, what, when, and its outcome (a status or refusal)."""
    RunAction.objects.create(run_id=run_id, action=action[:16], user=user, outcome=outcome)


def run_set_message(*, run_id: int, message: str) -> None:
    """Say on the run what it is doing or waiting for (shown on the dashboard)."""
    Run.objects.filter(pk=run_id).update(status_message=message, updated_at=timezone.now())
