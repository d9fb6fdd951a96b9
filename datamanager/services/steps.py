"""Storing steps: `steps_store` is the one function that writes Step rows, whatever the step
came from (an env slot's rollout, many slots' rollouts at once, an oracle or imported
demonstration, a trimmed copy). It takes `core.steps.StepRecord`s, the contract every layer
hands a step on with; `datamanager.selectors.steps` reads them back for training and export.

Cost: one step stores in two autocommit statements (the row, the trajectory's length), with
no transaction around them: on PostgreSQL a step's cost is its round trips
(bench/overhead.py), and BEGIN/COMMIT would add two. Many steps (a process that serves
hundreds of slots, bench/scale.py's driver) store in one transaction: one multi-row INSERT, one
UPDATE of the trajectories' lengths, one commit, so each commit's WAL flush is shared. Either
way a stored step is committed before `steps_store` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import Q

from core.steps import StepRecord, pack_token_ids
from datamanager.events import publish_on_commit
from datamanager.models import Step, Trajectory


def storable(value: Any) -> Any:
    """`value` with every NUL character of its strings (nested in lists and dicts too) made
    U+FFFD. PostgreSQL's text and jsonb refuse NUL ("text fields cannot contain NUL (0x00)
    bytes"), and an untrained policy's byte-level tokens decode to it: without this, a step
    the model wrote NUL in would end its episode as an environment error on PostgreSQL only.
    Training re-uses the token ids, not the text, so nothing it learns from changes."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


@dataclass
class TrajectoryHead:
    """What storing a step needs to know about its trajectory, read once per episode by the
    slot that owns it (`trajectory_head`) instead of once per step. `media_dir`: where its
    screenshots go in media storage."""

    pk: int
    run_id: int | None
    task_id: int
    env_slot_id: int | None
    policy_versions: list[int]
    media_dir: str

    @classmethod
    def of(cls, traj: Trajectory, *, media_dir: str | None = None) -> TrajectoryHead:
        return cls(
            pk=traj.pk,
            run_id=traj.run_id,
            task_id=traj.task_id,
            env_slot_id=traj.env_slot_id,
            policy_versions=list(traj.policy_versions),
            media_dir=media_dir or f"run-{traj.run_id or 0}/traj-{traj.pk}",
        )


def trajectory_head(*, trajectory_id: int) -> TrajectoryHead:
    traj = Trajectory.objects.only("pk", "run_id", "task_id", "env_slot_id", "policy_versions").get(
        pk=trajectory_id
    )
    return TrajectoryHead.of(traj)


@dataclass(frozen=True)
class StepWrite:
    """One step to store, with its trajectory's head."""

    head: TrajectoryHead
    record: StepRecord


def steps_store(*, writes: Sequence[StepWrite], resume: bool = False) -> list[Step]:
    """Store `writes` (steps of any trajectories, each owned by the caller): each row with
    its screenshot (none when `record.screenshot_png` is empty), each trajectory's length and
    policy versions, and, for a run's trajectory, the dashboard's `step` event on commit.
    Returns the writes' rows, in order (on a retry, a row an earlier try stored).

    `resume`: this call retries one that failed part-way (the database went away): a row an
    earlier try wrote is kept, not written twice, a screenshot file left without its row is
    replaced, and the trajectories' lengths are written again. A failure here deletes the
    screenshot files of the rows it did not store. The heads' policy versions are updated
    in place."""
    if not writes:
        return []
    done: dict[tuple[int, int], Step] = {}
    if resume:
        match = Q()
        for w in writes:
            match |= Q(trajectory_id=w.head.pk, index=w.record.index)
        done = {(s.trajectory_id, s.index): s for s in Step.objects.filter(match)}
    fresh = [w for w in writes if (w.head.pk, w.record.index) not in done]
    rows: list[Step] = []
    saved = 0  # rows[:saved] are stored
    try:
        for w in fresh:
            rows.append(_row(w, replace=resume))
        if len(writes) == 1:  # two autocommit statements (module docstring)
            for row in rows:
                row.save()
                saved += 1
            _update_trajectories(writes)
        else:
            with transaction.atomic():
                Step.objects.bulk_create(rows)
                _update_trajectories(writes)
            saved = len(rows)
    except BaseException:
        for row in rows[saved:]:  # no screenshot without its row
            if row.screenshot.name:
                default_storage.delete(row.screenshot.name)
        raise
    for row, w in zip(rows, fresh, strict=True):
        _publish(head=w.head, step=row, record=w.record)
        done[(w.head.pk, w.record.index)] = row
    return [done[(w.head.pk, w.record.index)] for w in writes]


def _row(write: StepWrite, *, replace: bool) -> Step:
    """The unsaved row of `write.record` (text made storable), its screenshot stored under
    the head's media_dir. With `replace`, a file an earlier, failed try left under the same
    name is deleted first."""
    record = write.record
    step = Step(
        trajectory_id=write.head.pk,
        index=record.index,
        screen_width=record.width,
        screen_height=record.height,
        raw_output=storable(record.raw_output),
        thought=storable(record.thought),
        action=storable(record.action),
        parse_error=storable(record.parse_error),
        prompt_tokens=record.prompt_tokens,
        prompt=storable(record.prompt),
        prompt_token_ids=pack_token_ids(record.prompt_token_ids),
        response_tokens=record.response_tokens,
        rollout_logprobs=record.rollout_logprobs,
        response_token_ids=record.response_token_ids or [],
        mean_entropy=record.mean_entropy,
        policy_version=record.policy_version,
        env_ms=record.env_ms,
        model_ms=record.model_ms,
    )
    if not record.screenshot_png:
        return step
    name = f"{write.head.media_dir}/{record.index:03d}.png"
    if replace:  # the file a failed try stored under this name, with no row to it
        stored = step.screenshot.field.generate_filename(step, name)
        if step.screenshot.storage.exists(stored):
            step.screenshot.storage.delete(stored)
    step.screenshot.save(name, ContentFile(record.screenshot_png), save=False)
    return step


def _update_trajectories(writes: Sequence[StepWrite]) -> None:
    """Each written trajectory's length (its last stored step's index + 1) and the policy
    versions its steps came from."""
    lengths: dict[int, int] = {}
    heads: dict[int, TrajectoryHead] = {}
    for w in writes:
        lengths[w.head.pk] = max(lengths.get(w.head.pk, 0), w.record.index + 1)
        heads[w.head.pk] = w.head
        version = w.record.policy_version
        if version is not None and version not in w.head.policy_versions:
            w.head.policy_versions.append(version)
    if len(lengths) == 1:
        [(pk, n)] = lengths.items()
        Trajectory.objects.filter(pk=pk).update(
            length=n, policy_versions=list(heads[pk].policy_versions)
        )
        return
    Trajectory.objects.bulk_update(
        [
            Trajectory(pk=pk, length=n, policy_versions=list(heads[pk].policy_versions))
            for pk, n in lengths.items()
        ],
        ["length", "policy_versions"],
    )


def _publish(*, head: TrajectoryHead, step: Step, record: StepRecord) -> None:
    """The dashboard's `step` event of a stored step of a run's trajectory, on commit."""
    if not head.run_id:
        return
    publish_on_commit(
        run_id=head.run_id,
        kind="step",
        data={
            "slot": head.env_slot_id,
            "trajectory": head.pk,
            "task": head.task_id,
            "step": record.index,
            "image": f"/media/{step.screenshot.name}",
            "policy_version": record.policy_version,
            "action": record.action,
            "parse_error": record.parse_error,
        },
    )
