"""A run's metrics as tables a script reads (the API's JSON and CSV, `dartboard metrics`, the
sweep page): greedy success per version with its interval, the rollouts' success rate and
throughput over time, and each update's metrics (the log-prob gap among them). The same reads
as the run page's charts (`charts.chart_data`), so both show the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from datamanager.models import Run, SweepMember
from datamanager.selectors.charts import ChartData, VersionPoint, chart_data, version_success
from datamanager.services.sweeps import point_label

KINDS = ("greedy", "success", "throughput", "updates")


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[Any]]


def run_metrics(*, run: Run) -> ChartData:
    return chart_data(run=run, max_tasks=0)


def greedy_points(versions: dict[str, list[VersionPoint]]) -> list[tuple[str, VersionPoint]]:
    """(scope, point) for every finished scheduled evaluation, by scope then version."""
    return [(scope, p) for scope, points in versions.items() for p in points]


def metrics_table(data: ChartData, kind: str) -> Table:
    """One kind of `KINDS` as rows (ValueError for another kind)."""
    if kind == "greedy":
        return Table(
            ["scope", "version", "ok", "scored", "rate", "low", "high"],
            [
                [s, p.version, p.ok, p.scored, p.rate, p.low, p.high]
                for s, p in greedy_points(data.versions)
            ],
        )
    if kind == "success":
        return Table(
            ["t", "success_rate"],
            [list(r) for r in zip(data.success.t, data.success.values, strict=True)],
        )
    if kind == "throughput":
        tp = data.throughput
        return Table(
            ["t", "actions_per_min", "trajectories_per_min"],
            [list(r) for r in zip(tp.t, tp.actions_per_min, tp.trajectories_per_min, strict=True)],
        )
    if kind == "updates":
        upd = data.updates
        keys = list(upd.series)
        return Table(
            ["update", *keys],
            [[n, *(upd.series[k][i] for k in keys)] for i, n in enumerate(upd.number)],
        )
    raise ValueError(f"no metrics {kind!r}; kinds: {', '.join(KINDS)}")


@dataclass(frozen=True)
class SweepCurve:
    """One member of a sweep: its run, grid values and seed, and greedy success per version
    and scope."""

    member: SweepMember
    label: str
    versions: dict[str, list[VersionPoint]]


def sweep_curves(*, sweep_id: int) -> list[SweepCurve]:
    members = SweepMember.objects.filter(sweep_id=sweep_id).select_related("run").order_by("index")
    return [
        SweepCurve(member=m, label=point_label(m.overrides), versions=version_success(run=m.run))
        for m in members
    ]


def sweep_greedy_table(*, sweep_id: int) -> Table:
    """Greedy success per version of every member of a sweep, with the member's values: the
    sweep page's curves as rows."""
    curves = sweep_curves(sweep_id=sweep_id)
    keys: list[str] = []
    for curve in curves:
        keys += [k for k in curve.member.overrides if k not in keys]
    # The same columns on every database (PostgreSQL's jsonb reorders keys): the grid's
    # settings by name, the seed last.
    keys.sort(key=lambda k: (k == "seed", k))
    rows = []
    for curve in curves:
        values = [curve.member.overrides.get(k) for k in keys]
        for scope, p in greedy_points(curve.versions):
            rows.append(
                [
                    curve.member.run_id,
                    *values,
                    scope,
                    p.version,
                    p.ok,
                    p.scored,
                    p.rate,
                    p.low,
                    p.high,
                ]
            )
    return Table(["run", *keys, "scope", "version", "ok", "scored", "rate", "low", "high"], rows)
