"""Human curation: experience-pool promotion, trimming, rejection, reward overrides, task
overrides and the import of pre-collected trajectories.

Each service is one transaction and raises `CurationError` with a message for the user.
Storage files are written only after validation; files written by a failed import are
deleted before the error propagates.
"""

from __future__ import annotations

from typing import IO

from django.contrib.auth.models import User
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import transaction
from django.utils import timezone

from datamanager.archive import archive_read
from datamanager.models import (
    SCORED_STATUSES,
    RewardOverride,
    RewardSource,
    Step,
    Task,
    TaskStat,
    Trajectory,
    TrajectorySource,
    TrajectoryStatus,
)
from datamanager.services.pool import DemoStep, demo_step_store


class CurationError(ValueError):
    """A curation action is not allowed; the message says why."""


def pool_sizes_refresh(*, task_ids: set[int]) -> None:
    """TaskStat.pool_size of every run with these tasks := the tasks' pool counts."""
    for task_id in task_ids:
        n = Trajectory.objects.filter(task_id=task_id, in_pool=True, rejected=False).count()
        TaskStat.objects.filter(task_id=task_id).update(pool_size=n)


def _locked(trajectory_id: int) -> Trajectory:
    return Trajectory.objects.select_for_update(of=("self",)).get(pk=trajectory_id)


@transaction.atomic
def trajectory_promote(*, trajectory_id: int) -> Trajectory:
    """Put a successful trajectory into its task's experience pool."""
    traj = _locked(trajectory_id)
    if traj.rejected:
        raise CurationError("a rejected trajectory cannot join the experience pool")
    if traj.status != TrajectoryStatus.SUCCEEDED or not (traj.reward or 0) > 0:
        raise CurationError(
            f"only successful trajectories join the pool (this one is {traj.status}, "
            f"reward {traj.reward})"
        )
    if not traj.in_pool:
        traj.in_pool = True
        traj.save(update_fields=["in_pool"])
        pool_sizes_refresh(task_ids={traj.task_id})
    return traj


@transaction.atomic
def trajectory_unpool(*, trajectory_id: int) -> Trajectory:
    """Take a trajectory out of its task's experience pool."""
    traj = _locked(trajectory_id)
    if traj.in_pool:
        traj.in_pool = False
        traj.save(update_fields=["in_pool"])
        pool_sizes_refresh(task_ids={traj.task_id})
    return traj


@transaction.atomic
def trajectory_reject(*, trajectory_id: int) -> Trajectory:
    """Mark a trajectory as never to be trained on (and take it out of the pool)."""
    traj = _locked(trajectory_id)
    traj.rejected = True
    was_pooled = traj.in_pool
    traj.in_pool = False
    traj.save(update_fields=["rejected", "in_pool"])
    if was_pooled:
        pool_sizes_refresh(task_ids={traj.task_id})
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
    written: list[str] = []
    try:
        for s in steps:
            new = Step(
                trajectory=copy,
                index=s.index,
                screen_width=s.screen_width,
                screen_height=s.screen_height,
                raw_output=s.raw_output,
                thought=s.thought,
                action=s.action,
                parse_error=s.parse_error,
                prompt_tokens=s.prompt_tokens,
                response_tokens=s.response_tokens,
                rollout_logprobs=s.rollout_logprobs,
                mean_entropy=s.mean_entropy,
                policy_version=s.policy_version,
                env_ms=s.env_ms,
                model_ms=s.model_ms,
            )
            shot = s.screenshot.name  # a FieldFile is truthy exactly when it has a name
            if shot and default_storage.exists(shot):
                with default_storage.open(shot, "rb") as fh:
                    data = fh.read()
                new.screenshot.save(
                    f"curated/traj-{copy.pk}/{s.index:03d}.png", ContentFile(data), save=False
                )
                assert new.screenshot.name is not None  # save() stored it under this name
                written.append(new.screenshot.name)
            new.save()
    except BaseException:
        _delete_files(written)
        raise
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
    pool_sizes_refresh(task_ids={traj.task_id})
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


def trajectories_import(*, fileobj: IO[bytes], in_pool: bool) -> list[Trajectory]:
    """Import an upload archive (format: `datamanager.archive`) all or nothing.

    Raises `archive.InvalidUpload` before touching storage or the database when the
    archive is invalid. Imported trajectories have source=precollected, no run, status
    succeeded when reward > 0 (else failed), and join the pool when `in_pool` and succeeded.
    """
    known = set(Task.objects.values_list("name", flat=True))
    items = archive_read(fileobj=fileobj, known_tasks=known)
    written: list[str] = []
    try:
        with transaction.atomic():
            tasks = {t.name: t for t in Task.objects.filter(name__in={i.task for i in items})}
            now = timezone.now()
            out = []
            for item in items:
                ok = item.reward > 0
                traj = Trajectory.objects.create(
                    task=tasks[item.task],
                    status=TrajectoryStatus.SUCCEEDED if ok else TrajectoryStatus.FAILED,
                    reward=item.reward,
                    length=len(item.steps),
                    finished_at=now,
                    source=TrajectorySource.PRECOLLECTED,
                    in_pool=in_pool and ok,
                    instruction=item.instruction or tasks[item.task].instruction,
                )
                for j, s in enumerate(item.steps):
                    demo = DemoStep(s.png, s.width, s.height, s.raw_output, s.thought, s.action)
                    step = demo_step_store(
                        trajectory=traj,
                        index=j,
                        step=demo,
                        path=f"precollected/traj-{traj.pk}/{j:03d}.png",
                    )
                    assert step.screenshot.name is not None  # save() stored it under this name
                    written.append(step.screenshot.name)
                out.append(traj)
            pool_sizes_refresh(task_ids={t.pk for t in tasks.values()})
    except BaseException:
        _delete_files(written)
        raise
    return out


def _delete_files(keys: list[str]) -> None:
    for key in keys:
        default_storage.delete(key)
