"""Which steps of an update train, and with what advantage and weight: group advantages over
the trajectories of a task, DART's high-entropy step selection, and each kept step's weight
in the policy-gradient loss. `training.update.policy_update` runs the plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.losses import (
    broadcast_to_steps,
    group_advantages,
    high_entropy_mask,
    recenter_kept_advantages,
    trajectory_step_weights,
)
from core.samples import TrainSample
from training.config import CurationConfig, TrainerConfig

ADV_EPS = 1e-6  # added to a group's reward std before dividing


@dataclass
class UpdatePlan:
    """Which steps train and with what advantage (index-aligned with the samples)."""

    advantage: list[float]
    pg_keep: list[bool]  # Gets policy-gradient signal.
    entropy_kept: dict[int, bool]  # step_id -> decision, for steps the entropy filter ranked.
    # Weight of each kept step in the pg loss: 1 / kept steps of its trajectory in its group
    # ("trajectory" aggregation), else 1; 0 for steps that do not train.
    step_weight: list[float]
    n_groups: int
    skipped_groups: int


def plan_update(
    samples: Sequence[TrainSample], config: TrainerConfig, curation: CurationConfig
) -> UpdatePlan:
    """Group advantages over trajectories (group = task), then the high-entropy step filter.

    The entropy filter ranks the online steps of non-skipped groups by their rollout-time
    `mean_entropy` and keeps the top `curation.entropy_q`; demo steps (experience pool) are
    always kept, since their entropy was measured under another policy, if at all. Then, with
    `entropy_recenter`, the kept steps' advantages are made zero-mean again per group; each
    kept step's weight follows `config.loss_aggregation`.

    Raises:
        ValueError: steps of one trajectory in one group disagree on its reward.
    """
    # A trajectory is a member of a group: an experience-pool demo may join the groups of
    # several all-failed rounds of its task, and two of them can land in one batch.
    members = [(s.group_id, s.trajectory_id) for s in samples]
    traj_pos: dict[tuple[int, int], int] = {}
    rewards: list[float] = []
    tasks: list[int] = []
    for s, member in zip(samples, members, strict=True):
        pos = traj_pos.get(member)
        if pos is None:
            traj_pos[member] = len(rewards)
            rewards.append(s.reward)
            tasks.append(s.group_id)
        elif rewards[pos] != s.reward:
            raise ValueError(
                f"step {s.step_id} of trajectory {s.trajectory_id} has reward {s.reward}, but an "
                f"earlier step of it in group {s.group_id} has {rewards[pos]}: all steps of a "
                "trajectory share its reward"
            )
    traj_adv, traj_keep, skipped = group_advantages(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(tasks), eps=ADV_EPS
    )
    step_index = torch.tensor([traj_pos[m] for m in members], dtype=torch.long)
    advantage = broadcast_to_steps(traj_adv, step_index).tolist()
    group_keep = broadcast_to_steps(traj_keep, step_index).tolist()
    step_group = [s.group_id for s in samples]

    ranked = [i for i, s in enumerate(samples) if group_keep[i] and not s.is_demo]
    entropy_kept: dict[int, bool] = {}
    if ranked:
        entropies = torch.tensor([samples[i].mean_entropy for i in ranked], dtype=torch.float64)
        keep = high_entropy_mask(entropies, q=curation.entropy_q).tolist()
        entropy_kept = {samples[i].step_id: k for i, k in zip(ranked, keep, strict=True)}
    pg_keep = [
        bool(group_keep[i]) and (s.is_demo or entropy_kept[s.step_id])
        for i, s in enumerate(samples)
    ]
    keep_t = torch.tensor(pg_keep, dtype=torch.bool)
    if config.loss_aggregation == "trajectory":
        member_ids = torch.tensor([traj_pos[m] for m in members], dtype=torch.long)
        weights = trajectory_step_weights(member_ids, keep_t)
    else:
        weights = keep_t.to(torch.float64)
    if curation.entropy_recenter and curation.entropy_q < 1 and any(pg_keep):
        advantage = recenter_kept_advantages(
            torch.tensor(advantage, dtype=torch.float64),
            torch.tensor(step_group),
            keep_t,
            weights,
        ).tolist()
    return UpdatePlan(
        advantage=[float(a) for a in advantage],
        pg_keep=pg_keep,
        entropy_kept=entropy_kept,
        step_weight=weights.tolist(),
        n_groups=len(set(tasks)),
        skipped_groups=skipped,
    )
