"""Building training batches from ready groups, and writing back what an update did.

Selection rules (all switchable in the run config):
- only groups whose rollouts are all finished (status ready), oldest first;
- staleness: steps from policy versions older than current - k are flagged `stale` and
  left out (counted, never deleted);
- each online step is trained on at most `max_uses_per_step` times;
- experience-pool trajectories joined to an all-failed group come in as demo samples;
- rejected trajectories and environment errors never train;
- a trajectory whose screenshots can no longer be read (lost from the object storage) is
  left out, marked rejected with the reason, and the run says so: the trainer goes on with
  the rest instead of failing on it at every retry.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from django.db import transaction

from core.samples import TrainSample, UpdateMetrics
from datamanager import curation
from datamanager.config import RunConfig
from datamanager.models import (
    SCORED_STATUSES,
    GroupStatus,
    Run,
    Step,
    TaskGroup,
    TaskStat,
    TrainUpdate,
    Trajectory,
)
from datamanager.selectors.pool import pool_members
from datamanager.selectors.steps import trajectory_turns
from datamanager.services.pool import pool_refresh
from datamanager.services.runs import run_set_message


@dataclass
class Batch:
    samples: list[TrainSample]
    group_ids: list[int]
    stale_step_ids: list[int] = field(default_factory=list)
    overused_step_ids: list[int] = field(default_factory=list)
    # Ready groups left with nothing to train: every step stale or used up, and no pool demo.
    empty_group_ids: list[int] = field(default_factory=list)
    # Trajectories left out because a screenshot of theirs is gone from storage.
    unreadable_ids: list[int] = field(default_factory=list)


def trajectory_samples(
    traj: Trajectory,
    steps: list[Step],
    *,
    group_id: int,
    cfg: RunConfig,
    is_demo: bool,
    keep: set[int] | None = None,
    version_for_demo: int = 0,
) -> list[TrainSample]:
    """One TrainSample per step (those in `keep`), read by `selectors.steps.trajectory_turns`:
    the prompt the policy was given and its token ids as the server reported them."""
    out = []
    for turn in trajectory_turns(traj, steps, cfg=cfg, keep=keep):
        step = turn.step
        if turn.messages is None:
            raise ValueError(f"step {step.pk} of trajectory {traj.pk} has no screenshot")
        out.append(
            TrainSample(
                step_id=step.pk,
                trajectory_id=traj.pk,
                group_id=group_id,
                messages=turn.messages,
                response_text=turn.reply,
                reward=float(traj.reward or 0.0),
                rollout_logprobs=list(step.rollout_logprobs or []),
                mean_entropy=float(step.mean_entropy or 0.0),
                policy_version=step.policy_version
                if step.policy_version is not None
                else version_for_demo,
                is_demo=is_demo,
                response_token_ids=list(step.response_token_ids) or None,
                prompt_token_ids=turn.prompt_token_ids or None,
            )
        )
    return out


def _readable_samples(
    batch: Batch, run: Run, traj: Trajectory, steps: list[Step], **kwargs
) -> list[TrainSample]:
    """`trajectory_samples`, or none when a screenshot is gone from storage: the trajectory
    is then marked rejected with the reason (its row and other steps stay) and the run says
    which one was left out and why."""
    try:
        return trajectory_samples(traj, steps, **kwargs)
    except FileNotFoundError as exc:
        reason = f"left out of training: a screenshot is missing from storage ({exc})"
        Trajectory.objects.filter(pk=traj.pk).update(
            rejected=True, in_pool=False, error=(traj.error + "\n" + reason).strip()
        )
        if traj.in_pool:
            pool_refresh(task_ids={traj.task_id})
        batch.unreadable_ids.append(traj.pk)
        run_set_message(run_id=run.pk, message=f"trainer: trajectory {traj.pk} {reason}")
        return []


def batch_collect(*, run: Run, current_version: int, min_groups: int | None = None) -> Batch | None:
    """The next batch, or None while fewer than `min_groups` (default: the run's) are ready."""
    cfg = run.cfg
    needed = cfg.trainer.min_groups if min_groups is None else min_groups
    groups = list(
        TaskGroup.objects.filter(run=run, status=GroupStatus.READY).order_by("ready_at", "pk")[:64]
    )
    if len(groups) < needed or not groups:
        return None
    batch = Batch(samples=[], group_ids=[])
    for group in groups:
        trajs = list(
            Trajectory.objects.filter(
                group=group, status__in=SCORED_STATUSES, rejected=False
            ).order_by("pk")
        )
        steps_by_traj: dict[int, list[Step]] = defaultdict(list)
        for step in Step.objects.filter(trajectory__in=trajs).order_by("trajectory_id", "index"):
            steps_by_traj[step.trajectory_id].append(step)
        group_samples: list[TrainSample] = []
        for traj in trajs:
            steps = steps_by_traj[traj.pk]
            keep = set()
            for step in steps:
                if curation.is_stale(
                    step_version=step.policy_version,
                    current_version=current_version,
                    k=cfg.curation.staleness_k,
                ):
                    batch.stale_step_ids.append(step.pk)
                elif step.train_uses >= cfg.curation.max_uses_per_step:
                    batch.overused_step_ids.append(step.pk)
                else:
                    keep.add(step.pk)
            if keep:
                group_samples += _readable_samples(
                    batch, run, traj, steps, group_id=group.pk, cfg=cfg, is_demo=False, keep=keep
                )
        for demo in Trajectory.objects.filter(pk__in=group.pool_members, rejected=False):
            steps = list(demo.steps.order_by("index"))
            group_samples += _readable_samples(
                batch,
                run,
                demo,
                steps,
                group_id=group.pk,
                cfg=cfg,
                is_demo=True,
                version_for_demo=current_version,
            )
        if not group_samples:
            batch.empty_group_ids.append(group.pk)
            continue
        if (
            batch.samples
            and len(batch.samples) + len(group_samples) > cfg.trainer.max_steps_per_update
        ):
            break
        batch.samples += group_samples
        batch.group_ids.append(group.pk)
    return batch


def pool_batch(
    *,
    run: Run,
    cfg: RunConfig,
    current_version: int,
    seed: int,
    max_steps: int | None = None,
    exclude: Collection[int] = (),
) -> Batch | None:
    """Demo samples from the experience pool of the run's tasks (the behaviour-cloning warm
    start, and the demos mixed into RL updates).

    Up to `max_steps` steps (default `max_steps_per_update`), a different shuffle per update
    (seeded); the trajectories in `exclude` are left out."""
    limit = cfg.trainer.max_steps_per_update if max_steps is None else max_steps
    task_ids = list(
        TaskStat.objects.filter(run=run, retired=False).values_list("task_id", flat=True)
    )
    demos = list(pool_members(task_id__in=task_ids).exclude(pk__in=exclude).order_by("pk"))
    if not demos:
        return None
    random.Random(seed).shuffle(demos)
    batch = Batch(samples=[], group_ids=[])
    for demo in demos:
        steps = list(demo.steps.order_by("index"))
        if batch.samples and len(batch.samples) + len(steps) > limit:
            break
        # Each demo is its own group: no advantage signal, only the BC term trains.
        batch.samples += trajectory_samples(
            demo, steps, group_id=-demo.pk, cfg=cfg, is_demo=True, version_for_demo=current_version
        )
    return batch


def pool_mix(*, batch: Batch, run: Run, cfg: RunConfig, current_version: int, seed: int) -> int:
    """Add `trainer.pool_mix_steps` experience-pool demo steps to an RL batch (a new draw per
    `seed`; demos already in the batch through a pool join are not drawn twice). Returns the
    steps added."""
    if not cfg.trainer.pool_mix_steps:
        return 0
    mix = pool_batch(
        run=run,
        cfg=cfg,
        current_version=current_version,
        seed=seed,
        max_steps=cfg.trainer.pool_mix_steps,
        exclude={s.trajectory_id for s in batch.samples},
    )
    if mix is None:
        return 0
    batch.samples += mix.samples
    return len(mix.samples)


@transaction.atomic
def batch_commit(
    *, run: Run, batch: Batch, metrics: UpdateMetrics, trained_version: int, kind: str = "rl"
) -> TrainUpdate:
    """Record an update: metrics, each step's trainer view, the groups consumed."""
    number = (TrainUpdate.objects.filter(run=run).count()) + 1
    update = TrainUpdate.objects.create(
        run=run,
        number=number,
        policy_version=trained_version,
        metrics={
            **metrics.as_json(),
            "kind": kind,
            "stale_steps": len(batch.stale_step_ids),
            "overused_steps": len(batch.overused_step_ids),
            "groups": len(batch.group_ids),
            "empty_groups": len(batch.empty_group_ids),
        },
    )
    batch_skip(batch=batch)
    online = [s for s in batch.samples if not s.is_demo]
    steps = {s.pk: s for s in Step.objects.filter(pk__in=[s.step_id for s in online])}
    for sample in online:
        step = steps[sample.step_id]
        step.trained_in_update = update
        step.train_uses += 1
        step.advantage = metrics.step_advantage.get(sample.step_id)
        step.is_weight = metrics.step_is_weight.get(sample.step_id)
        step.entropy_kept = metrics.step_entropy_kept.get(sample.step_id)
    Step.objects.bulk_update(
        steps.values(),
        ["trained_in_update", "train_uses", "advantage", "is_weight", "entropy_kept"],
    )
    TaskGroup.objects.filter(pk__in=batch.group_ids).update(status=GroupStatus.TRAINED)
    return update


@transaction.atomic
def batch_skip(*, batch: Batch) -> str:
    """Write back what a batch left out: its stale steps are flagged and the groups it had
    nothing to train from are marked skipped, so they leave the ready queue (otherwise a queue
    head of wholly stale groups would be collected again on every try and never trained).
    Returns a line for the run's message, or "" when nothing was left out."""
    Step.objects.filter(pk__in=batch.stale_step_ids).update(stale=True)
    TaskGroup.objects.filter(pk__in=batch.empty_group_ids).update(status=GroupStatus.SKIPPED)
    if not batch.empty_group_ids:
        return ""
    return (
        f"skipped {len(batch.empty_group_ids)} ready groups with nothing left to train "
        f"({len(batch.stale_step_ids)} stale steps, {len(batch.overused_step_ids)} used up)"
    )
