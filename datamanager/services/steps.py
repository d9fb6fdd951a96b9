"""Recording the steps of many trajectories at once: for a process that serves many env slots.

`episodes.step_store` stores one step in two autocommit statements, so each step costs two
commits, and on PostgreSQL with synchronous_commit each commit waits for its WAL flush. A
process that serves hundreds of slots (bench/scale.py's driver) collects the steps its slots
record within a few milliseconds and writes them with `steps_store_many`: one transaction,
one multi-row INSERT, one UPDATE of the trajectories' lengths, one commit. Each slot still
waits until its step is committed, so a recorded step is a stored step, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction
from django.db.models import Q

from datamanager.models import Step, Trajectory
from datamanager.services.episodes import TrajectoryHead, head_add_version, step_build, step_publish
from rollout.episode import StepRecord


@dataclass(frozen=True)
class StepWrite:
    """One step to store (what `episodes.step_store` takes), with its trajectory's head."""

    head: TrajectoryHead
    record: StepRecord


def steps_store_many(*, writes: list[StepWrite], resume: bool = False) -> int:
    """Store `writes` (steps of any trajectories, each owned by the caller's slots) in one
    transaction, each row, screenshot and dashboard event as `episodes.step_store` makes
    it. Returns how many rows were inserted.

    `resume`: this call retries one that failed (the database went away mid-way): steps an
    earlier try stored are kept, not written twice; a screenshot file left without its row
    is replaced. The heads' policy versions are updated in place, as `step_store` does."""
    if not writes:
        return 0
    done: set[tuple[int, int]] = set()
    if resume:
        match = Q()
        for w in writes:
            match |= Q(trajectory_id=w.head.pk, index=w.record.index)
        done = set(Step.objects.filter(match).values_list("trajectory_id", "index"))
    fresh = [w for w in writes if (w.head.pk, w.record.index) not in done]
    rows = [step_build(head=w.head, record=w.record, resume=resume) for w in fresh]
    lengths: dict[int, int] = {}
    heads: dict[int, TrajectoryHead] = {}
    for w in writes:
        lengths[w.head.pk] = max(lengths.get(w.head.pk, 0), w.record.index + 1)
        heads[w.head.pk] = w.head
        head_add_version(w.head, w.record.policy_version)
    with transaction.atomic():
        Step.objects.bulk_create(rows)
        Trajectory.objects.bulk_update(
            [
                Trajectory(pk=pk, length=n, policy_versions=list(heads[pk].policy_versions))
                for pk, n in lengths.items()
            ],
            ["length", "policy_versions"],
        )
        for step, w in zip(rows, fresh, strict=True):
            step_publish(head=w.head, step=step, record=w.record)
    return len(rows)
