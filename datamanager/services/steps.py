"""Recording the steps of many trajectories at once: for a process that serves many env slots.

`episodes.step_record` stores one step in two autocommit statements, so each step costs two
commits, and on PostgreSQL with synchronous_commit each commit waits for its WAL flush. A
process that serves hundreds of slots (bench/scale.py's driver) collects the steps its slots
record within a few milliseconds and writes them with `steps_record_many`: one transaction,
one multi-row INSERT, one UPDATE of the trajectories' lengths, one commit. Each slot still
waits until its step is committed, so a recorded step is a stored step, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.core.files.base import ContentFile
from django.db import transaction
from django.db.models import Q

from datamanager.events import publish_on_commit
from datamanager.models import Step, Trajectory
from datamanager.services.episodes import TrajectoryHead, storable
from rollout.episode import StepRecord


@dataclass(frozen=True)
class StepWrite:
    """One step to store (what `episodes.step_record` takes), with its trajectory's head."""

    head: TrajectoryHead
    record: StepRecord


def _screenshot_name(w: StepWrite) -> str:
    return f"run-{w.head.run_id or 0}/traj-{w.head.pk}/{w.record.index:03d}.png"


def steps_record_many(*, writes: list[StepWrite], resume: bool = False) -> int:
    """Store `writes` (steps of any trajectories, each owned by the caller's slots) in one
    transaction. Returns how many rows were inserted.

    `resume`: this call retries one that failed (the database went away mid-way): steps an
    earlier try stored are kept, not written twice; a screenshot file left without its row
    is replaced. The heads' policy versions are updated in place, as `step_record` does."""
    if not writes:
        return 0
    done: set[tuple[int, int]] = set()
    if resume:
        match = Q()
        for w in writes:
            match |= Q(trajectory_id=w.head.pk, index=w.record.index)
        done = set(Step.objects.filter(match).values_list("trajectory_id", "index"))
    rows = []
    for w in writes:
        if (w.head.pk, w.record.index) in done:
            continue
        step = Step(
            trajectory_id=w.head.pk,
            index=w.record.index,
            screen_width=w.record.width,
            screen_height=w.record.height,
            raw_output=storable(w.record.raw_output),
            thought=storable(w.record.thought),
            action=storable(w.record.action),
            parse_error=storable(w.record.parse_error),
            prompt_tokens=w.record.prompt_tokens,
            response_tokens=w.record.response_tokens,
            rollout_logprobs=w.record.rollout_logprobs,
            response_token_ids=w.record.response_token_ids or [],
            mean_entropy=w.record.mean_entropy,
            policy_version=w.record.policy_version,
            env_ms=w.record.env_ms,
            model_ms=w.record.model_ms,
        )
        name = _screenshot_name(w)
        if resume:
            stored = step.screenshot.field.generate_filename(step, name)
            if step.screenshot.storage.exists(stored):
                step.screenshot.storage.delete(stored)
        step.screenshot.save(name, ContentFile(w.record.screenshot_png), save=False)
        rows.append(step)
    lengths: dict[int, int] = {}
    heads: dict[int, TrajectoryHead] = {}
    for w in writes:
        lengths[w.head.pk] = max(lengths.get(w.head.pk, 0), w.record.index + 1)
        heads[w.head.pk] = w.head
        if (
            w.record.policy_version is not None
            and w.record.policy_version not in w.head.policy_versions
        ):
            w.head.policy_versions.append(w.record.policy_version)
    with transaction.atomic():
        Step.objects.bulk_create(rows)
        Trajectory.objects.bulk_update(
            [
                Trajectory(pk=pk, length=n, policy_versions=list(heads[pk].policy_versions))
                for pk, n in lengths.items()
            ],
            ["length", "policy_versions"],
        )
        for step, w in zip(
            rows, (w for w in writes if (w.head.pk, w.record.index) not in done), strict=True
        ):
            if w.head.run_id:
                publish_on_commit(
                    run_id=w.head.run_id,
                    kind="step",
                    data={
                        "slot": w.head.env_slot_id,
                        "trajectory": w.head.pk,
                        "task": w.head.task_id,
                        "step": w.record.index,
                        "image": f"/media/{step.screenshot.name}",
                        "policy_version": w.record.policy_version,
                        "action": w.record.action,
                        "parse_error": w.record.parse_error,
                    },
                )
    return len(rows)
