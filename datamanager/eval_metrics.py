"""Evaluation statistics as pure functions: unbiased pass@k, Wilson intervals, task rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from datamanager.models import SCORED_STATUSES, TrajectoryStatus


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes: 1 - C(n-c, k) / C(n, k)."""
    if n <= 0 or k <= 0:
        raise ValueError(f"pass@k needs n > 0 and k > 0, got n={n}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate (sensible at 0 and n)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class Episode:
    task: str
    status: str  # a TrajectoryStatus value
    reward: float
    steps: int
    parse_errors: int


@dataclass(frozen=True)
class TaskResult:
    task: str
    episodes: int  # scored episodes (env errors excluded)
    env_errors: int
    successes: int
    success_rate: float
    ci_low: float
    ci_high: float
    mean_reward: float
    pass_at_1: float
    pass_at_k: float
    mean_steps_of_successes: float | None
    parse_error_rate: float

    def as_json(self) -> dict:
        return asdict(self)


def task_result(task: str, episodes: Sequence[Episode], k: int) -> TaskResult:
    """Env errors are reported apart and never counted as policy failures."""
    scored = [e for e in episodes if e.status in SCORED_STATUSES]
    errors = sum(e.status == TrajectoryStatus.ERROR for e in episodes)
    n, c = len(scored), sum(e.status == TrajectoryStatus.SUCCEEDED for e in scored)
    lo, hi = wilson_interval(c, n)
    steps = [e.steps for e in scored if e.status == TrajectoryStatus.SUCCEEDED]
    total_steps = sum(e.steps for e in scored)
    return TaskResult(
        task=task,
        episodes=n,
        env_errors=errors,
        successes=c,
        success_rate=c / n if n else 0.0,
        ci_low=lo,
        ci_high=hi,
        mean_reward=sum(e.reward for e in scored) / n if n else 0.0,
        pass_at_1=pass_at_k(n, c, 1) if n else 0.0,
        pass_at_k=pass_at_k(n, c, min(k, n)) if n else 0.0,
        mean_steps_of_successes=sum(steps) / len(steps) if steps else None,
        parse_error_rate=sum(e.parse_errors for e in scored) / total_steps if total_steps else 0.0,
    )


def summary(results: Sequence[TaskResult]) -> dict:
    """Macro averages over tasks, plus pooled counts with their interval."""
    n = sum(r.episodes for r in results)
    c = sum(r.successes for r in results)
    lo, hi = wilson_interval(c, n)
    tasks = [r for r in results if r.episodes]
    return {
        "tasks": len(results),
        "episodes": n,
        "successes": c,
        "env_errors": sum(r.env_errors for r in results),
        "success_rate": c / n if n else 0.0,
        "ci_low": lo,
        "ci_high": hi,
        "mean_pass_at_1": sum(r.pass_at_1 for r in tasks) / len(tasks) if tasks else 0.0,
        "mean_pass_at_k": sum(r.pass_at_k for r in tasks) / len(tasks) if tasks else 0.0,
    }
