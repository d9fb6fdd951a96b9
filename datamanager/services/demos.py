"""Importing demonstrations: OSWorld result folders, AgentNet lines and Dartboard's own
upload archive, all or nothing.

Every episode is read and checked first (`datamanager.demos`), its task found, its content
hash compared with what is stored; only then is anything written, in one transaction, each
screenshot read once more on the way. A failure while writing deletes the screenshots
already saved, so a broken import leaves nothing behind.

Imported trajectories have source=precollected and no run. They wait in the review queue
(succeeded, not reviewed, not pooled, not rejected) until a curator accepts them into their
task's experience pool or rejects them; `accept=True` accepts them on import.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from core.actions import format_action
from core.steps import StepRecord
from datamanager.archive import InvalidUpload
from datamanager.demos.agentnet import agentnet_read
from datamanager.demos.episodes import DemoEpisode, DemoFiles, shot_png
from datamanager.demos.manifest import manifest_read
from datamanager.demos.osworld import DemoRead, osworld_read
from datamanager.models import Task, Trajectory, TrajectorySource, TrajectoryStatus
from datamanager.selectors.steps import REPLY_FROM_ACTION
from datamanager.services.pool import pool_refresh
from datamanager.services.review import screenshots_delete
from datamanager.services.steps import StepWrite, TrajectoryHead, steps_store

DemoFormat = Literal["osworld", "agentnet", "dartboard"]
DEMO_FORMATS: tuple[DemoFormat, ...] = ("osworld", "agentnet", "dartboard")
MAX_ERRORS = 50


@dataclass
class ImportReport:
    """What an import did: the trajectories it wrote, the episodes it passed over (already
    stored, or not demonstrations) and what a user should know about the rest."""

    trajectory_ids: list[int] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def demos_read(
    *, files: DemoFiles, fmt: DemoFormat, screen: tuple[int, int] | None = None
) -> DemoRead:
    """The episodes of `files` in format `fmt`, checked; nothing is stored."""
    if fmt == "osworld":
        return osworld_read(files, screen=screen)
    if fmt == "agentnet":
        return agentnet_read(files)
    return manifest_read(files)


def demos_import(
    *,
    files: DemoFiles,
    fmt: DemoFormat,
    accept: bool = False,
    user: User | None = None,
    screen: tuple[int, int] | None = None,
    task: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> ImportReport:
    """Import every episode of `files`, or nothing: raises `InvalidUpload` listing every
    problem (file and line first) before anything is written. `task`: the Dartboard task
    every episode belongs to (else each episode's own task id or name). `progress(done,
    total)` is called as episodes are written."""
    read = demos_read(files=files, fmt=fmt, screen=screen)
    errors = list(read.errors)
    tasks = _tasks_for(read.episodes, task, errors)
    if not read.episodes and not errors:
        errors.append(
            f"{files.label}: no episode to import"
            + (f" ({len(read.skipped)} passed over: {read.skipped[0]})" if read.skipped else "")
        )
    if errors:
        raise InvalidUpload(
            errors[:MAX_ERRORS]
            + (["... (more errors not shown)"] if len(errors) > MAX_ERRORS else [])
        )
    report = ImportReport(skipped=list(read.skipped))
    hashes = {id(ep): ep.content_hash(tasks[id(ep)].name) for ep in read.episodes}
    stored = set(
        Trajectory.objects.filter(content_hash__in=set(hashes.values())).values_list(
            "content_hash", flat=True
        )
    )
    fresh: list[DemoEpisode] = []
    for ep in read.episodes:
        if hashes[id(ep)] in stored:
            report.duplicates.append(f"{ep.source}: already imported (same content)")
            continue
        stored.add(hashes[id(ep)])  # the same episode twice in one import: once
        fresh.append(ep)
    written: list[str] = []
    try:
        with transaction.atomic():
            for n, ep in enumerate(fresh, start=1):
                traj = _store(files, ep, tasks[id(ep)], hashes[id(ep)], fmt, accept, user, written)
                report.trajectory_ids.append(traj.pk)
                report.notes += [f"{ep.source}: {note}" for note in ep.notes]
                if progress is not None:
                    progress(n, len(fresh))
            pool_refresh(task_ids={t.pk for t in tasks.values()})
    except BaseException:
        screenshots_delete(written)
        raise
    return report


def import_summary(report: ImportReport) -> str:
    """One line for the user: what was imported and what was passed over."""
    parts = [f"Imported {len(report.trajectory_ids)} trajectories"]
    if report.duplicates:
        parts.append(f"{len(report.duplicates)} already imported (skipped)")
    if report.skipped:
        parts.append(f"{len(report.skipped)} not demonstrations (skipped)")
    if report.notes:
        parts.append(f"{len(report.notes)} note(s)")
    return "; ".join(parts) + "."


def _tasks_for(episodes: list[DemoEpisode], task: str, errors: list[str]) -> dict[int, Task]:
    """Each episode's task (by id(episode)); an unknown one is an error naming close names."""
    names = list(Task.objects.values_list("name", flat=True))
    by_name = {
        t.name: t
        for t in Task.objects.filter(
            name__in={task} if task else {k for ep in episodes for k in _candidates(ep.task_key)}
        )
    }
    out: dict[int, Task] = {}
    for ep in episodes:
        keys = [task] if task else _candidates(ep.task_key)
        found = next((by_name[k] for k in keys if k in by_name), None)
        if found is None:
            close = difflib.get_close_matches(keys[0], names, n=3, cutoff=0.6)
            hint = f"; close names: {', '.join(close)}" if close else ""
            errors.append(
                f"{ep.source}: no task named {' or '.join(repr(k) for k in keys)}{hint} "
                "(import it first: manage.py import_tasks, or name one with --task)"
            )
            continue
        out[id(ep)] = found
    return out


def _candidates(key: str) -> list[str]:
    """The task names an episode's key may be: itself, or an OSWorld task id's name."""
    return [key] if key.startswith("osworld/") else [key, f"osworld/{key}"]


def _store(
    files: DemoFiles,
    ep: DemoEpisode,
    task: Task,
    content_hash: str,
    fmt: DemoFormat,
    accept: bool,
    user: User | None,
    written: list[str],
) -> Trajectory:
    ok = ep.reward > 0
    now = timezone.now()
    details: dict = {"import": {"format": fmt, "source": ep.source, "notes": ep.notes}}
    if fmt != "dartboard":  # Dartboard's archive carries the replies a policy wrote
        details[REPLY_FROM_ACTION] = True
    traj = Trajectory.objects.create(
        task=task,
        status=TrajectoryStatus.SUCCEEDED if ok else TrajectoryStatus.FAILED,
        reward=ep.reward,
        length=len(ep.steps),
        finished_at=now,
        source=TrajectorySource.PRECOLLECTED,
        in_pool=accept and ok,
        instruction=ep.instruction or task.instruction,
        content_hash=content_hash,
        reviewed_at=now if accept else None,
        reviewed_by=user if accept else None,
        details=details,
    )
    records = []
    for j, s in enumerate(ep.steps):
        reply = s.recorded if fmt == "dartboard" else _reply(s.action, s.thought)
        records.append(
            StepRecord.demonstration(
                index=j,
                screenshot_png=shot_png(files, s.shot),
                width=s.shot.width,
                height=s.shot.height,
                raw_output=reply,
                thought=s.thought,
                action=s.action.to_json(),
            )
        )
    head = TrajectoryHead.of(traj, media_dir=f"precollected/traj-{traj.pk}")
    for step in steps_store(writes=[StepWrite(head=head, record=r) for r in records]):
        assert step.screenshot.name is not None  # steps_store stored it under this name
        written.append(step.screenshot.name)
    return traj


def _reply(action, thought: str) -> str:
    """Dartboard's text of an imported action in screen pixels (what the trajectory page
    shows; training writes it for its own policy: `selectors.steps.step_reply`)."""
    try:
        return format_action(action, thought=thought)
    except ValueError:  # a thought holding a line that starts with "Action:"
        return format_action(action)
