"""Reads for the run page's charts: every series it plots, bucketed in SQL, as a `ChartData`
that `dartboard.figures` turns into Plotly figures.

Plain reads (no locks, no writes), safe from any process. Time series come from one grouped
pass over the run's finished trajectories (`aggregates.outcome_rows`) and a few grouped
queries, so a run with 10,000 trajectories and 200,000 steps returns a few hundred rows, not
the raw history (bench/pages.py measures the chart endpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db.models import Avg, Count, F, FloatField, Max, Q, Sum
from django.db.models.functions import Cast, Coalesce, Now

from datamanager.eval_metrics import wilson_interval
from datamanager.models import (
    SCORED_STATUSES,
    EnvSlot,
    EvalScope,
    EvalStatus,
    Run,
    TaskGroup,
    TaskStatHistory,
    TrainUpdate,
    Trajectory,
    TrajectorySource,
    TrajectoryStatus,
)
from datamanager.selectors.aggregates import (
    EpochSeconds,
    bucket_index,
    bucket_label,
    bucket_width,
    fold,
    iso,
    outcome_rows,
    with_times,
)

Row = dict[str, Any]  # an `outcome_rows` row


@dataclass(frozen=True)
class Series:
    """One line over time: bucket start times (ISO, UTC) and a value per bucket."""

    t: list[str | None]
    values: list[float | None]


@dataclass(frozen=True)
class TaskHistory:
    """A task's rollout budget and step cap per bucket (the mean of its groups there)."""

    t: list[str | None]
    budget: list[float]
    step_cap: list[float]


@dataclass(frozen=True)
class Throughput:
    t: list[str]
    actions_per_min: list[float]
    trajectories_per_min: list[float]


@dataclass(frozen=True)
class Utilisation:
    """Busy shares per bucket, in [0, 1]."""

    env: Series  # the run's slots' time spent in online trajectories
    trainer: Series  # the trainer's time spent in updates
    slots: int  # the run's env slots (at least 1)


@dataclass(frozen=True)
class TrainingMetrics:
    """Per-update scalar metrics of the run's latest updates, oldest first."""

    number: list[int]  # the updates' numbers
    series: dict[str, list[float | None]]  # metric -> a value per update (None: not measured)
    staleness: dict[str, int]  # the latest update's steps per "versions behind"
    latest_version: int | None  # the latest update's policy version
    gap_alert: float  # the run's trainer.logprob_gap_alert (0: off)
    latest_passes: str = ""  # the latest update's forward passes, e.g. "ref+grad"


@dataclass(frozen=True)
class GroupPoint:
    """A GRPO group with an ended member: when its last member ended, its mean reward."""

    id: int
    t: str | None
    task: str
    index: int
    status: str
    n: int  # ended (succeeded or failed) members
    mean: float | None


@dataclass(frozen=True)
class VersionPoint:
    """Greedy success of one policy version in one finished scheduled evaluation."""

    version: int
    ok: int
    scored: int
    rate: float
    low: float  # the 95% Wilson interval
    high: float


@dataclass(frozen=True)
class ChartData:
    """Every series the run page charts (`chart_data`)."""

    run_id: int
    bucket: str  # the bucket width, for people ("5 min")
    bucket_s: float  # the bucket width in seconds (a point's trajectory-list window)
    success: Series  # the success rate of finished trajectories per bucket
    per_task: dict[str, Series]  # the same per task (the first `max_tasks` tasks)
    history: dict[str, TaskHistory]  # per task (the first `max_tasks`)
    throughput: Throughput
    utilisation: Utilisation
    updates: TrainingMetrics
    groups: list[GroupPoint]
    versions: dict[str, list[VersionPoint]]  # per EvalScope value, by version


def chart_data(*, run: Run, rows: list[Row] | None = None, max_tasks: int = 40) -> ChartData:
    """Every series the run page charts, bucketed in SQL. See `dartboard.figures`.
    `rows`: the run's `aggregates.outcome_rows` when the caller has them already."""
    width = bucket_width(run)
    if rows is None:
        rows = outcome_rows(run=run, width=width)
    return ChartData(
        run_id=run.pk,
        bucket=bucket_label(width),
        bucket_s=width.total_seconds(),
        success=_success(rows),
        per_task=dict(list(_success_per_task(rows).items())[:max_tasks]),
        history=dict(list(_task_history(run=run, width=width).items())[:max_tasks]),
        throughput=_throughput(rows, width),
        utilisation=utilisation(run=run, width=width),
        updates=training_metrics(run=run),
        groups=group_points(run=run),
        versions=version_success(run=run),
    )


def _finished(r: Row) -> bool:
    return r["status"] in SCORED_STATUSES


def _n(r: Row) -> int:
    return r["n"]


def _ok(r: Row) -> int:
    return r["n"] if r["status"] == TrajectoryStatus.SUCCEEDED else 0


def _success(rows: list[Row]) -> Series:
    folded = fold(rows, (), _finished, n=_n, ok=_ok)
    return Series(
        t=[iso(r["b"]) for r in folded],
        values=[r["ok"] / r["n"] if r["n"] else None for r in folded],
    )


def _success_per_task(rows: list[Row]) -> dict[str, Series]:
    per_task: dict[str, Series] = {}
    for r in fold(rows, ("task__name",), _finished, n=_n, ok=_ok):
        s = per_task.setdefault(r["task__name"], Series(t=[], values=[]))
        s.t.append(iso(r["b"]))
        s.values.append(r["ok"] / r["n"])
    return per_task


def _task_history(*, run: Run, width: timedelta) -> dict[str, TaskHistory]:
    """A task's budget and step cap, averaged per bucket like every other series: one point
    per finished group made 13,500 points (1.1 MB, 300 ms) at 1,000,000 steps."""
    history: dict[str, TaskHistory] = {}
    for r in with_times(
        TaskStatHistory.objects.filter(run=run)
        .annotate(b=bucket_index("at", width))
        .values("task__name", "b")
        .annotate(n=Count("pk"), budget=Sum("rollout_budget"), cap=Sum("step_cap"))
        .order_by("task__name", "b"),
        width,
    ):
        h = history.setdefault(r["task__name"], TaskHistory(t=[], budget=[], step_cap=[]))
        h.t.append(iso(r["b"]))
        h.budget.append(round(r["budget"] / r["n"], 2))
        h.step_cap.append(round(r["cap"] / r["n"], 2))
    return history


def _throughput(rows: list[Row], width: timedelta) -> Throughput:
    """Actions are counted per finished trajectory (its length), not per Step row: bucketing
    200,000 step timestamps costs a second on SQLite, 10,000 trajectories a few ms."""
    minutes = width.total_seconds() / 60
    rates = fold(rows, (), lambda r: True, n=_n, n_steps=lambda r: r["n_steps"] or 0)
    traj_rate: dict[str, float] = {}
    action_rate: dict[str, float] = {}
    for r in rates:
        t = iso(r["b"])
        assert t is not None  # outcome rows are finished trajectories
        traj_rate[t] = r["n"] / minutes
        action_rate[t] = (r["n_steps"] or 0) / minutes
    times = sorted(set(traj_rate) | set(action_rate))
    return Throughput(
        t=times,
        actions_per_min=[action_rate.get(t, 0) for t in times],
        trajectories_per_min=[traj_rate.get(t, 0) for t in times],
    )


def version_success(*, run: Run) -> dict[str, list[VersionPoint]]:
    """Greedy success per policy version from the run's finished scheduled evaluations, per
    scope (training instances, held-out seeds, the eval split), with the 95% Wilson interval
    (the evaluation report's)."""
    scopes = (EvalScope.TRAIN_INSTANCES, EvalScope.HELDOUT, EvalScope.EVAL_SPLIT)
    rows = (
        Trajectory.objects.filter(
            eval_job__run=run, eval_job__scope__in=scopes, eval_job__status=EvalStatus.FINISHED
        )
        .values("eval_job_id", "eval_job__scope", "eval_job__policy_version")
        .annotate(
            ok=Count("pk", filter=Q(status=TrajectoryStatus.SUCCEEDED)),
            scored=Count("pk", filter=Q(status__in=SCORED_STATUSES)),
        )
        .order_by("eval_job__policy_version", "eval_job_id")
    )
    out: dict[str, list[VersionPoint]] = {str(scope): [] for scope in scopes}
    for r in rows:
        if not r["scored"] or r["eval_job__policy_version"] is None:
            continue
        low, high = wilson_interval(r["ok"], r["scored"])
        out[r["eval_job__scope"]].append(
            VersionPoint(
                version=r["eval_job__policy_version"],
                ok=r["ok"],
                scored=r["scored"],
                rate=r["ok"] / r["scored"],
                low=low,
                high=high,
            )
        )
    return out


def version_best(*, run: Run) -> int | None:
    """The version with the highest greedy success on held-out seeds (else on the training
    instances, else the eval split); the newest among equals. None before any evaluation."""
    points = version_success(run=run)
    for scope in (EvalScope.HELDOUT, EvalScope.TRAIN_INSTANCES, EvalScope.EVAL_SPLIT):
        if points[str(scope)]:
            return max(points[str(scope)], key=lambda p: (p.rate, p.version)).version
    return None


def group_points(*, run: Run, limit: int = 300) -> list[GroupPoint]:
    """The run's latest `limit` groups with an ended member, oldest first (the groups chart;
    a point opens the group)."""
    scored = Q(trajectories__status__in=SCORED_STATUSES)
    rows = (
        TaskGroup.objects.filter(run=run)
        .annotate(
            n=Count("trajectories", filter=scored),
            mean=Avg("trajectories__reward", filter=scored),
            last=Max("trajectories__finished_at"),
        )
        .filter(n__gt=0)
        .order_by("-last", "-pk")
        .values("pk", "index", "status", "task__name", "n", "mean", "last")[:limit]
    )
    return [
        GroupPoint(
            id=r["pk"],
            t=iso(r["last"]),
            task=r["task__name"],
            index=r["index"],
            status=r["status"],
            n=r["n"],
            mean=r["mean"],
        )
        for r in reversed(list(rows))
    ]


def utilisation(*, run: Run, width: timedelta) -> Utilisation:
    """Env busy share per bucket and trainer busy share per bucket.

    Env: the summed duration of trajectories (start -> finish, or now while running) that
    started in a bucket, over the slot-time of the run's slots in that bucket. A trajectory
    longer than a bucket is credited to the bucket it started in, which is exact enough at
    the chart's resolution. Trainer: summed `metrics.duration_s` of updates per bucket.
    Durations are computed by the database (`EpochSeconds`).
    """
    n_slots = EnvSlot.objects.filter(run=run).count() or 1
    seconds = EpochSeconds(Coalesce(F("finished_at"), Now())) - EpochSeconds(F("started_at"))
    rows = with_times(
        Trajectory.objects.filter(run=run, source=TrajectorySource.ONLINE)
        .annotate(b=bucket_index("started_at", width))
        .values("b")
        .annotate(busy=Sum(seconds))
        .order_by("b"),
        width,
    )
    slot_seconds = n_slots * width.total_seconds()
    trainer_rows = with_times(
        TrainUpdate.objects.filter(run=run)
        .annotate(
            b=bucket_index("created_at", width), d=Cast(F("metrics__duration_s"), FloatField())
        )
        .values("b")
        .annotate(busy=Sum("d"))
        .order_by("b"),
        width,
    )
    return Utilisation(
        env=Series(
            t=[iso(r["b"]) for r in rows],
            values=[min(1.0, (r["busy"] or 0) / slot_seconds) for r in rows],
        ),
        trainer=Series(
            t=[iso(r["b"]) for r in trainer_rows],
            values=[min(1.0, (r["busy"] or 0.0) / width.total_seconds()) for r in trainer_rows],
        ),
        slots=n_slots,
    )


def training_metrics(*, run: Run, limit: int = 2000) -> TrainingMetrics:
    """Per-update metrics (the last `limit` updates) and the latest staleness histogram."""
    rows = list(
        TrainUpdate.objects.filter(run=run)
        .order_by("-number")
        .values_list("number", "policy_version", "metrics")[:limit]
    )
    rows.reverse()
    scalar_keys: list[str] = []
    for _, _, m in rows:
        for k, v in (m or {}).items():
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in scalar_keys:
                scalar_keys.append(k)
    staleness = {}
    if rows:
        raw = (rows[-1][2] or {}).get("staleness") or {}
        if isinstance(raw, dict):
            staleness = {str(k): v for k, v in raw.items()}
    return TrainingMetrics(
        number=[n for n, _, _ in rows],
        series={k: [(m or {}).get(k) for _, _, m in rows] for k in scalar_keys},
        staleness=staleness,
        latest_version=rows[-1][1] if rows else None,
        gap_alert=run.cfg.trainer.logprob_gap_alert,
        latest_passes=str((rows[-1][2] or {}).get("passes") or "") if rows else "",
    )
