"""DART's curation policies as small pure functions (the services in `datamanager.services.episodes`
and `datamanager.services.batches` apply them to the database).

1. rollout-wise sampling: `pick_task` — the task whose open group is closest to full;
2. dynamic rollout number: `rollout_budget` — n_max below a threshold, else
   max(n_min, floor(9/s - 7)) (s=0.7 -> 5, 0.8 -> 4, 0.9 -> 3, 1.0 -> 2);
3. dynamic trajectory length: `step_cap` — the longest success plus a margin;
4. experience pool: `pool_fill_count` — how many pool successes join an all-failed group;
5. staleness: `is_stale` — steps from versions older than current - k are left out.

And `group_seed`: the start state every rollout of a group shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def rollout_budget(
    *, success_rate: float | None, n_max: int, n_min: int, threshold: float, dynamic: bool
) -> int:
    """Rollouts for a task's next group. No history yet (None) counts as 'below threshold'."""
    if not dynamic or success_rate is None or success_rate < threshold:
        return n_max
    # 9/s - 7 is DART's rule; the epsilon keeps floor(9/0.9 - 7) at 3 despite float error.
    n = math.floor(9.0 / success_rate - 7.0 + 1e-9)
    return max(n_min, min(n_max, n))


def step_cap(*, longest_success: int | None, default_cap: int, margin: int, dynamic: bool) -> int:
    """A task's step cap: its longest successful trajectory plus a margin, else the default."""
    if not dynamic or longest_success is None:
        return default_cap
    return max(1, longest_success + margin)


def rolling_success_rate(outcomes: Sequence[bool], window: int) -> float | None:
    """Success rate over the last `window` outcomes (oldest first); None when there are none."""
    recent = list(outcomes)[-window:]
    if not recent:
        return None
    return sum(recent) / len(recent)


@dataclass(frozen=True)
class Candidate:
    task_id: int
    outstanding: int
    boost: float = 1.0


def pick_task(candidates: Sequence[Candidate]) -> int | None:
    """The task whose open group has the fewest claims left (divided by its boost); ties go
    to the lowest id. Groups fill one after another: a group is ready for the trainer within
    a few episodes of its first. Filling every task's group side by side (the largest
    outstanding budget first, as this did) finished each group only at the end of the round,
    two versions later on 3 slots, and the trainer left half of the rollouts out as stale."""
    live = [c for c in candidates if c.outstanding > 0 and c.boost > 0]
    if not live:
        return None
    best = min(live, key=lambda c: (c.outstanding / c.boost, c.task_id))
    return best.task_id


def pool_fill_count(
    *, group_size: int, all_failed: bool, pool_size: int, ratio: float, enabled: bool
) -> int:
    """Pool successes that join a group: only when every online rollout failed."""
    if not enabled or not all_failed or pool_size == 0 or group_size == 0 or ratio <= 0:
        return 0
    return min(pool_size, max(1, round(ratio * group_size)))


def is_stale(*, step_version: int | None, current_version: int, k: int) -> bool:
    """True when a step was produced by a version older than current - k."""
    if step_version is None:
        return False  # demonstrations carry no policy version and never go stale
    return step_version < current_version - k


# Fixed training instances use seeds (INSTANCE_SEED_BASE + run seed) * 1000 + i, i < N, so an
# evaluation job with seed INSTANCE_SEED_BASE + run seed and k = N plays exactly those
# instances (the evaluation harness seeds episode i with job.seed * 1000 + i).
INSTANCE_SEED_BASE = 500_000


def group_seed(
    *, run_seed: int, group_pk: int, group_index: int, instances: int, heldout_seed: int
) -> int:
    """The environment seed of every rollout of a task group: GRPO's advantage compares
    outcomes from the same start state. `instances` = 0: a new seed for each group;
    N > 0: a task's groups cycle through its N fixed training instances (like OSWorld's
    fixed tasks). Never one of the held-out seeds (`heldout_seed` * 1000 + i, i < 1000: what
    the held-out evaluation scores must be unseen; the fixed instances' block differs from it
    by the run config's check). Decoding seeds stay per rollout (the claim's `decode_seed`)."""
    if instances:  # a task's group indexes count from 1
        return (INSTANCE_SEED_BASE + run_seed) * 1000 + (group_index - 1) % instances
    seed = run_seed * 1_000_003 + group_pk
    return seed + 1000 if seed // 1000 == heldout_seed else seed
