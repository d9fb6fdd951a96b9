"""Human curation: review (accept or reject), experience-pool promotion, trimming, rejection,
reward overrides and task overrides. Importing demonstrations is `services.demos`.

Each service is one transaction and raises `CurationError` with a message for the user.
Files written by a failed curation are deleted before the error propagates.
"""

from __future__ import annotations

from django.contrib.auth.models import User
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from datamanager.models import (
    SCORED_STATUSES,
    RewardOverride,
    RewardSource,
    Step,
    TaskStat,
    Trajectory,
    TrajectorySource,
    TrajectoryStatus,
)
from datamanager.selectors.steps import step_record
from datamanager.services.pool import pool_refresh
from datamanager.services.steps import StepWrite, TrajectoryHead, steps_store


class CurationError(ValueError):
    """A curation action is not allowed; the message says why."""


def _locked(trajectory_id: int) -> Trajectory:
    return Trajectory.objects.select_for_update(of=("self",)).get(pk=trajectory_id)


def _reviewed(traj: Trajectory, user: User | None) -> list[str]:
    """Mark `traj` reviewed by `user` now (a person's decision); the fields to save."""
    if user is None:
        return []
    traj.reviewed_at = timezone.now()
    traj.reviewed_by = user
    return ["reviewed_at", "reviewed_by"]


@transaction.atomic
def trajectory_promote(*, trajectory_id: int, user: User | None = None) -> Trajectory:
    """Put a successful trajectory into its task's experience pool (a curator's accept:
    it leaves the review queue)."""
    traj = _locked(trajectory_id)
    if traj.rejected:
        raise CurationError("a rejected trajectory cannot join the experience pool")
    if traj.status != TrajectoryStatus.SUCCEEDED or not (traj.reward or 0) > 0:
        raise CurationError(
            f"only successful trajectories join the pool (this one is {traj.status}, "
            f"reward {traj.reward})"
        )
    was_pooled = traj.in_pool
    traj.in_pool = True
    traj.save(update_fields=["in_pool", *_reviewed(traj, user)])
    if not was_pooled:
        pool_refresh(task_ids={traj.task_id})
    return traj


@transaction.atomic
def trajectory_unpool(*, trajectory_id: int) -> Trajectory:
    """Take a trajectory out of its task's experience pool."""
    traj = _locked(trajectory_id)
    if traj.in_pool:
        traj.in_pool = False
        traj.save(update_fields=["in_pool"])
        pool_refresh(task_ids={traj.task_id})
    return traj


@transaction.atomic
def trajectory_reject(*, trajectory_id: int, user: User | None = None) -> Trajectory:
    """Mark a trajectory as never to be trained on (and take it out of the pool; a
    curator's reject: it leaves the review queue)."""
    traj = _locked(trajectory_id)
    traj.rejected = True
    was_pooled = traj.in_pool
    traj.in_pool = False
    traj.save(update_fields=["rejected", "in_pool", *_reviewed(traj, user)])
    if was_pooled:
        pool_refresh(task_ids={traj.task_id})
    return traj


@transaction.atomic
def trajectory_trim(*, trajectory_id: int, keep_steps: int) -> Trajectory:
    """A curated copy holding the first `keep_steps` steps (screenshots copied).

    The copy keeps the original's reward and status, has source=curated and
    curated_from=original, and belongs to no training group. The original is unchanged.
    """
    traj = _locked(trajectory_id)
    if traj.status == TrajectoryStatus.RUNNING:
        raise CurationError("the trajectory is still running; trim it once it has finished")
    steps = list(Step.objects.filter(trajectory=traj).order_by("index")[:keep_steps])
    if not 1 <= keep_steps < traj.length:
        raise CurationError(
            f"keep between 1 and {max(1, traj.length - 1)} steps (it has {traj.length})"
        )
    copy = Trajectory.objects.create(
        run=traj.run,
        task=traj.task,
        status=traj.status,
        reward=traj.reward,
        reward_source=traj.reward_source,
        reward_override_by=traj.reward_override_by,
        reward_override_reason=traj.reward_override_reason,
        length=len(steps),
        finished_at=timezone.now(),
        source=TrajectorySource.CURATED,
        purpose=traj.purpose,
        curated_from=traj,
        policy_versions=sorted({s.policy_version for s in steps if s.policy_version is not None}),
        details={"trimmed_from": traj.pk, "kept_steps": len(steps)},
        instruction=traj.instruction,
        step_cap=traj.step_cap,
        seed=traj.seed,
    )
    records = []
    for s in steps:
        shot = s.screenshot.name  # a FieldFile is truthy exactly when it has a name
        data = b""
        if shot and default_storage.exists(shot):
            with default_storage.open(shot, "rb") as fh:
                data = fh.read()
        records.append(step_record(s, screenshot_png=data))
    head = TrajectoryHead.of(copy, media_dir=f"curated/traj-{copy.pk}")
    steps_store(writes=[StepWrite(head=head, record=r) for r in records])
    return copy


@transaction.atomic
def trajectory_override_reward(
    *, trajectory_id: int, reward: float, reason: str, user: User | None
) -> Trajectory:
    """Replace a trajectory's reward, with an audit row (who, old, new, why).

    A finished trajectory's status follows the new reward (succeeded if > 0, else failed).
    """
    if not reason.strip():
        raise CurationError("say why the reward is overridden")
    if not 0.0 <= reward <= 1.0:
        raise CurationError(f"reward must be in [0, 1], got {reward}")
    traj = _locked(trajectory_id)
    if traj.status == TrajectoryStatus.RUNNING:
        raise CurationError("the trajectory is still running; override its reward once it ends")
    RewardOverride.objects.create(
        trajectory=traj, user=user, old_reward=traj.reward, new_reward=reward, reason=reason
    )
    traj.reward = reward
    traj.reward_source = RewardSource.HUMAN
    traj.reward_override_by = user
    traj.reward_override_reason = reason
    fields = ["reward", "reward_source", "reward_override_by", "reward_override_reason"]
    if traj.status in SCORED_STATUSES:
        traj.status = TrajectoryStatus.SUCCEEDED if reward > 0 else TrajectoryStatus.FAILED
        fields.append("status")
        if traj.status == TrajectoryStatus.FAILED and traj.in_pool:
            traj.in_pool = False
            fields.append("in_pool")
    traj.save(update_fields=fields)
    pool_refresh(task_ids={traj.task_id})
    return traj


@transaction.atomic
def taskstat_override(
    *,
    stat_id: int,
    pinned_budget: int | None,
    boost: float,
    retired: bool,
    reason: str,
    user: User | None,
) -> TaskStat:
    """Pin a task's rollout budget, boost its sampling weight or retire it; the change,
    the user, the time and the reason are appended to `override_note`."""
    if not reason.strip():
        raise CurationError("say why the task is overridden")
    if pinned_budget is not None and not 1 <= pinned_budget <= 64:
        raise CurationError("a pinned budget must be between 1 and 64")
    if not 0 < boost <= 100:
        raise CurationError("boost must be in (0, 100]")
    stat = TaskStat.objects.select_for_update(of=("self",)).get(pk=stat_id)
    changes = []
    if pinned_budget != stat.pinned_budget:
        changes.append(f"budget pinned to {pinned_budget}" if pinned_budget else "budget unpinned")
    if boost != stat.boost:
        changes.append(f"boost {stat.boost:g} -> {boost:g}")
    if retired != stat.retired:
        changes.append("retired" if retired else "un-retired")
    if not changes:
        raise CurationError("nothing changed")
    who = getattr(user, "username", "") or "unknown user"
    line = f"{timezone.now():%Y-%m-%d %H:%M} UTC {who}: {', '.join(changes)} — {reason.strip()}"
    stat.pinned_budget = pinned_budget
    stat.boost = boost
    stat.retired = retired
    stat.override_note = f"{stat.override_note}\n{line}".strip()
    stat.save(update_fields=["pinned_budget", "boost", "retired", "override_note", "updated_at"])
    return stat


def screenshots_delete(keys: list[str]) -> None:
    """Delete these media files (screenshots a failed write had saved)."""
    for key in keys:
        default_storage.delete(key)
