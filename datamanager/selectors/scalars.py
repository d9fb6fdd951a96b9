"""A run's scalars at one trainer update, as experiment trackers take them (tag -> value):
what the exporters in workers/exports.py write to TensorBoard, W&B and MLflow at the update's
number; and the run's resolved config, flattened, as their run parameters."""

from __future__ import annotations

from django.db.models import Count, Q, Sum

from datamanager.models import (
    EnvSlot,
    Run,
    Step,
    TaskStat,
    TrainUpdate,
    Trajectory,
    TrajectoryStatus,
)

# Update metrics that are counts or settings of the batch rather than learning signals are
# still scalars; the per-step maps and the staleness histogram are not (exported apart).
_NOT_SCALARS = {"kind", "staleness"}


def run_scalars(*, update: TrainUpdate) -> dict[str, float]:
    """`train/*`: the update's metrics (loss, pg_loss, kl, bc_loss, entropy, IS weights,
    clip fraction, grad norm, advantages, sizes); `staleness/*`: online steps by versions
    behind; per task `success/`, `budget/` (rollouts per group), `step_cap/`, `pool/`;
    `curation/*`: the run's totals; `env/*`: trajectories by outcome and the env slots' busy
    time."""
    run_id = update.run_id
    scalars: dict[str, float] = {}
    for key, value in update.metrics.items():
        if key in _NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        scalars[f"train/{key}"] = float(value)
    for behind, steps in (update.metrics.get("staleness") or {}).items():
        scalars[f"staleness/{behind}_versions_behind"] = float(steps)
    stats = TaskStat.objects.filter(run_id=run_id).select_related("task")
    for stat in stats:
        name = stat.task.name
        scalars[f"success/{name}"] = stat.success_rate
        scalars[f"budget/{name}"] = float(stat.rollout_budget)
        scalars[f"step_cap/{name}"] = float(stat.step_cap)
        scalars[f"pool/{name}"] = float(stat.pool_size)
    scalars["curation/pool_size"] = float(sum(s.pool_size for s in stats))
    scalars["curation/retired_tasks"] = float(sum(1 for s in stats if s.retired))
    outcomes = Trajectory.objects.filter(run_id=run_id).aggregate(
        succeeded=Count("pk", filter=Q(status=TrajectoryStatus.SUCCEEDED)),
        failed=Count("pk", filter=Q(status=TrajectoryStatus.FAILED)),
        error=Count("pk", filter=Q(status=TrajectoryStatus.ERROR)),
    )
    for outcome, count in outcomes.items():
        scalars[f"env/trajectories_{outcome}"] = float(count)
    scalars["curation/stale_steps"] = float(
        Step.objects.filter(trajectory__run_id=run_id, stale=True).count()
    )
    busy = EnvSlot.objects.filter(run_id=run_id).aggregate(busy=Sum("env_busy_s"))["busy"]
    scalars["env/busy_s"] = float(busy or 0.0)
    return scalars


def run_params(*, run: Run) -> dict[str, str | int | float | bool | None]:
    """The run's resolved config (`Run.config`) flattened to dotted keys, e.g.
    `trainer.lr -> 0.001`; lists stay whole, as their text (`[1, 2]`)."""
    params: dict[str, str | int | float | bool | None] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif value is None or isinstance(value, (str, int, float, bool)):
            params[prefix] = value
        else:
            params[prefix] = str(value)

    walk("", run.config)
    return params
