"""Figure builders: Plotly figure JSON (plain dicts plotly.js renders) and small SVGs.

Plotly's Python `graph_objects` would validate the same dicts at a cost of milliseconds per
trace; the chart endpoint refreshes every few seconds, so the dicts are built directly.
`run_figures` draws the run page's charts, one function per chart, from the typed series of
`datamanager.selectors.charts.ChartData` (and `datamanager.selectors.env_health`'s health series).
The small SVGs (the reward histogram, sparklines, an action drawn on its screenshot) are
`dartboard.svg`'s.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django.urls import reverse

from datamanager.models import EvalScope
from datamanager.selectors.charts import ChartData, GroupPoint, VersionPoint
from datamanager.selectors.metrics import SweepCurve

_LAYOUT = {
    "margin": {"l": 48, "r": 12, "t": 36, "b": 36},
    "height": 280,
    "legend": {"orientation": "h", "y": -0.2},
    "paper_bgcolor": "#ffffff",
    "plot_bgcolor": "#ffffff",
    "font": {"size": 11},
}


def _fig(title: str, data: list[dict], **layout: Any) -> dict[str, Any]:
    lay = {**_LAYOUT, "title": {"text": title, "font": {"size": 13}}, **layout}
    if not data:
        lay["annotations"] = [
            {
                "text": "no data yet",
                "showarrow": False,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
                "font": {"color": "#6b7385"},
            }
        ]
    return {"data": data, "layout": lay}


def _line(name: str, x: list, y: list, **extra: Any) -> dict[str, Any]:
    return {"type": "scatter", "mode": "lines+markers", "name": name, "x": x, "y": y, **extra}


def trajectories_link(**query: Any) -> str:
    """The trajectory list filtered by `query` (None values left out)."""
    return (
        reverse("trajectories") + "?" + urlencode({k: v for k, v in query.items() if v is not None})
    )


def _window_links(charts: ChartData, times: list[str | None], **query: Any) -> list[str | None]:
    """Per chart point (a time bucket), the trajectory list of the rollouts that finished in
    that bucket: what a click on the point opens. (Two thousand points a refresh: the
    common part of the link is built once.)"""
    width = timedelta(seconds=charts.bucket_s)
    base = trajectories_link(run=charts.run_id, **query)
    return [
        base
        + "&"
        + urlencode(
            {"finished_from": t, "finished_to": (datetime.fromisoformat(t) + width).isoformat()}
        )
        if t
        else None
        for t in times
    ]


def _update_links(charts: ChartData, numbers: list[int]) -> list[str]:
    """Per update, the trajectory list of the rollouts it trained on."""
    return [trajectories_link(run=charts.run_id, update=n) for n in numbers]


_RATE_AXIS = {"range": [0, 1.05], "tickformat": ".0%"}
_SHOWN_LINES = 8  # lines per chart drawn at first; the rest wait in the legend
# The training chart's metrics in this order, the first four drawn at first.
_TRAINING_METRICS = (
    "loss",
    "pg_loss",
    "kl",
    "bc_loss",
    "mean_entropy",
    "clip_fraction",
    "is_weight_mean",
    "kept_step_fraction",
)


def _visible(i: int) -> bool | str:
    return True if i < _SHOWN_LINES else "legendonly"


def run_figures(charts: ChartData, health: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """All run-page charts from `datamanager.selectors.charts.chart_data` and
    `datamanager.selectors.env_health.health_chart_data`. A point's `customdata` is the page a click on
    it opens (static/dartboard/charts.js): the trajectories behind it, or its group."""
    return {
        "errors_host": _errors_figure(charts, health, "per_host", "Env error rate per host"),
        "errors_task": _errors_figure(charts, health, "per_task", "Env error rate per task"),
        "left_out": _left_out_figure(health),
        "groups": _groups_figure(charts.groups),
        "versions": _versions_figure(charts.versions),
        "success": _success_figure(charts),
        "budget": _history_figure(charts, "Rollout budget per task", "budget"),
        "step_cap": _history_figure(charts, "Step cap per task", "step_cap"),
        "throughput": _throughput_figure(charts),
        "utilisation": _utilisation_figure(charts),
        "training": _training_figure(charts),
        "update_phases": _update_phases_figure(charts),
        "logprob_gap": _logprob_gap_figure(charts),
        "staleness": _staleness_figure(charts),
    }


def _success_figure(charts: ChartData) -> dict[str, Any]:
    """The overall success rate per bucket, and each task's (the first few drawn)."""
    overall = charts.success
    traces = (
        [
            _line(
                "overall",
                overall.t,
                overall.values,
                line={"width": 3},
                customdata=_window_links(charts, overall.t),
            )
        ]
        if overall.t
        else []
    )
    for i, (task, s) in enumerate(sorted(charts.per_task.items())):
        traces.append(
            _line(
                task,
                s.t,
                s.values,
                visible=_visible(i),
                line={"width": 1},
                customdata=_window_links(charts, s.t, task=task, task_exact="on"),
            )
        )
    return _fig("Success rate", traces, yaxis=_RATE_AXIS)


def _history_figure(charts: ChartData, title: str, field: str) -> dict[str, Any]:
    """A task's curation knob (`field`: budget or step_cap) per bucket, as steps."""
    traces = [
        _line(task, h.t, getattr(h, field), line={"shape": "hv"}, visible=_visible(i))
        for i, (task, h) in enumerate(sorted(charts.history.items()))
    ]
    return _fig(title, traces, yaxis={"rangemode": "tozero"})


def _throughput_figure(charts: ChartData) -> dict[str, Any]:
    """Actions and trajectories per minute, on two axes."""
    tp = charts.throughput
    links = _window_links(charts, list(tp.t))
    traces = (
        [
            _line("actions/min", tp.t, tp.actions_per_min, customdata=links),
            _line("trajectories/min", tp.t, tp.trajectories_per_min, yaxis="y2", customdata=links),
        ]
        if tp.t
        else []
    )
    return _fig(
        "Throughput",
        traces,
        yaxis={"title": {"text": "actions/min"}, "rangemode": "tozero"},
        yaxis2={
            "title": {"text": "trajectories/min"},
            "overlaying": "y",
            "side": "right",
            "rangemode": "tozero",
        },
    )


def _utilisation_figure(charts: ChartData) -> dict[str, Any]:
    """The env slots' and the trainer's busy share per bucket."""
    util = charts.utilisation
    traces = [
        trace
        for trace in (
            _line(f"env ({util.slots} slots)", util.env.t, util.env.values),
            _line("trainer", util.trainer.t, util.trainer.values),
        )
        if trace["x"]
    ]
    return _fig("Utilisation (busy share)", traces, yaxis=_RATE_AXIS)


def _training_figure(charts: ChartData) -> dict[str, Any]:
    """Every scalar metric per update: the usual ones first, the rest in the legend."""
    upd = charts.updates
    links = _update_links(charts, upd.number)
    names = [
        *[k for k in _TRAINING_METRICS if k in upd.series],
        *[k for k in upd.series if k not in _TRAINING_METRICS],
    ]
    traces = [
        _line(
            k,
            upd.number,
            upd.series[k],
            visible=True if k in _TRAINING_METRICS[:4] else "legendonly",
            customdata=links,
        )
        for k in names
    ]
    return _fig("Training metrics per update", traces, xaxis={"title": {"text": "update"}})


# Where an update's time goes (training.update, training.trainer): seconds per phase.
_UPDATE_PHASES = (
    ("encode_s", "encoding prompts (inside the passes)"),
    ("old_pass_s", "old-policy pass"),
    ("ref_pass_s", "reference pass"),
    ("grad_pass_s", "gradient pass"),
    ("optimizer_s", "optimizer step"),
)


def _update_phases_figure(charts: ChartData) -> dict[str, Any]:
    """Each update's seconds by phase, and which forward passes the latest one ran (the
    old-policy pass is skipped when the gradient pass's own log-probs are pi_old's)."""
    upd = charts.updates
    links = _update_links(charts, upd.number)
    traces = [
        _line(label, upd.number, upd.series[key], customdata=links)
        for key, label in _UPDATE_PHASES
        if key in upd.series
    ]
    title = "Update time by phase (seconds)"
    if upd.latest_passes:
        title += f"; latest update's passes: {upd.latest_passes}"
    return _fig(title, traces, xaxis={"title": {"text": "update"}})


def _logprob_gap_figure(charts: ChartData) -> dict[str, Any]:
    """The trainer-vs-rollout log-prob gap per update, with the run's alert threshold."""
    upd = charts.updates
    links = _update_links(charts, upd.number)
    # An update that measured no token (a warm-start or all-stale batch) has no gap: a gap.
    measured = upd.series.get("logprob_gap_tokens") or [None] * len(upd.number)
    traces = [
        _line(
            f"{k.rsplit('_', 1)[-1]} per token",
            upd.number,
            [v if n else None for v, n in zip(upd.series[k], measured, strict=True)],
            customdata=links,
        )
        for k in ("logprob_gap_mean", "logprob_gap_p99")
        if k in upd.series
    ]
    if traces and upd.gap_alert:
        alert = upd.gap_alert
        traces.append(
            _line(
                "alert threshold (mean)",
                [upd.number[0], upd.number[-1]],
                [alert, alert],
                line={"dash": "dash", "color": "#c0392b"},
            )
        )
    return _fig(
        "Trainer vs rollout log-prob gap on fresh steps (nats)",
        traces,
        xaxis={"title": {"text": "update"}},
        yaxis={"rangemode": "tozero"},
    )


def _staleness_figure(charts: ChartData) -> dict[str, Any]:
    """The latest update's steps per number of versions behind the trained policy."""
    upd = charts.updates
    stale = upd.staleness
    keys = sorted(stale, key=lambda k: (len(k), k))
    traces = (
        [{"type": "bar", "x": keys, "y": [stale[k] for k in keys], "name": "steps"}]
        if stale
        else []
    )
    return _fig(
        f"Staleness of the latest update (policy v{upd.latest_version})"
        if stale
        else "Staleness of the latest update",
        traces,
        xaxis={"title": {"text": "versions behind"}, "type": "category"},
    )


def _success_line(name: str, points: list[VersionPoint], *, color: str, tag: str) -> dict[str, Any]:
    """Greedy success per policy version as one line, each point with its 95% interval and
    its successes out of the scored episodes on hover (`tag` names the line there)."""
    return _line(
        name,
        [p.version for p in points],
        [p.rate for p in points],
        line={"color": color},
        text=[f"{p.ok}/{p.scored}" for p in points],
        hovertemplate="v%{x}: %{y:.0%} (%{text})<extra>" + tag + "</extra>",
        error_y={
            "type": "data",
            "symmetric": False,
            "array": [p.high - p.rate for p in points],
            "arrayminus": [p.rate - p.low for p in points],
            "color": color,
        },
    )


def _versions_figure(versions: dict[str, list[VersionPoint]]) -> dict[str, Any]:
    """Greedy success per policy version on the training instances and on held-out seeds,
    each point with its 95% interval."""
    traces = []
    for scope, name, color in (
        (EvalScope.TRAIN_INSTANCES, "training instances", "#2f6fed"),
        (EvalScope.HELDOUT, "held-out seeds", "#c0392b"),
    ):
        points = versions.get(scope) or []
        if not points:
            continue
        traces.append(_success_line(name, points, color=color, tag=name))
    return _fig(
        "Greedy success per policy version (95% interval)",
        traces,
        # Integer ticks that plotly spaces itself (one per version crowds after ~20); the
        # legend goes below the axis title.
        xaxis={"title": {"text": "policy version"}, "tickformat": "d", "rangemode": "tozero"},
        yaxis={"range": [0, 1.05], "tickformat": ".0%"},
        margin={"l": 48, "r": 12, "t": 36, "b": 60},
        legend={"orientation": "h", "y": -0.32},
    )


def _groups_figure(groups: list[GroupPoint]) -> dict[str, Any]:
    """Each GRPO group as a point (when its last member ended, its mean reward); a click
    opens the group view."""
    data = (
        [
            {
                "type": "scatter",
                "mode": "markers",
                "name": "groups",
                "x": [g.t for g in groups],
                "y": [g.mean for g in groups],
                "text": [f"{g.task} · group {g.index} · {g.n} ended · {g.status}" for g in groups],
                "customdata": [reverse("group_detail", args=[g.id]) for g in groups],
                "hovertemplate": "%{text}<br>mean reward %{y:.2f}<extra>click: open</extra>",
                "marker": {
                    "size": 9,
                    "color": [g.mean for g in groups],
                    "colorscale": [[0, "#d64545"], [1, "#1f9d55"]],
                    "cmin": 0,
                    "cmax": 1,
                },
            }
        ]
        if groups
        else []
    )
    return _fig(
        "GRPO groups (mean reward; click one to open it)",
        data,
        yaxis={"title": {"text": "mean reward"}},
    )


def _errors_figure(
    charts: ChartData, health: dict[str, Any], key: str, title: str
) -> dict[str, Any]:
    """The env error rate over time per host (`key` per_host) or per task (per_task), from
    `env_health.error_rates`; a point opens the env errors behind it."""
    series = health.get("errors", {}).get(key, {})
    on_task = key == "per_task"
    traces = [
        _line(
            name,
            s["t"],
            s["rate"],
            visible=_visible(i),
            text=[f"{n} rollouts" for n in s["n"]],
            customdata=_window_links(
                charts,
                s["t"],
                env_error="yes",
                **({"task": name, "task_exact": "on"} if on_task else {"host": name}),
            ),
        )
        for i, (name, s) in enumerate(sorted(series.items()))
    ]
    return _fig(title, traces, yaxis=_RATE_AXIS)


def _left_out_figure(health: dict[str, Any]) -> dict[str, Any]:
    """The share of rollouts and of stale steps left out of training (`env_health.left_out`)."""
    left = health.get("left_out", {})
    traces = []
    if left.get("rollouts", {}).get("t"):
        r = left["rollouts"]
        traces.append(_line("rollouts: error, aborted or rejected", r["t"], r["share"]))
    if left.get("stale", {}).get("t"):
        traces.append(
            _line("steps: too stale (per update)", left["stale"]["t"], left["stale"]["share"])
        )
    return _fig("Left out of training (share)", traces, yaxis=_RATE_AXIS)


def eval_heatmap(
    *, columns: list[str], tasks: list[str], rates: list[list[float | None]]
) -> dict[str, Any]:
    """Success rate per task (rows) and evaluation job (columns); None: no scored episode."""
    data = (
        [
            {
                "type": "heatmap",
                "x": columns,
                "y": tasks,
                "z": rates,
                "zmin": 0,
                "zmax": 1,
                "colorscale": [[0, "#d64545"], [0.5, "#f2d27a"], [1, "#1f9d55"]],
                "colorbar": {"tickformat": ".0%", "thickness": 12},
                "text": [["—" if r is None else f"{r:.0%}" for r in row] for row in rates],
                "texttemplate": "%{text}",
                "hovertemplate": "%{y}<br>%{x}<br>success %{text}<extra></extra>",
                "xgap": 2,
                "ygap": 2,
            }
        ]
        if tasks and columns
        else []
    )
    return _fig(
        "Success rate per task",
        data,
        height=max(280, 120 + 24 * len(tasks)),
        margin={"l": 200, "r": 12, "t": 36, "b": 120},
        xaxis={"type": "category", "tickangle": -30},
        yaxis={"type": "category", "autorange": "reversed"},
    )


SWEEP_COLORS = [
    "#2f6fed",
    "#c0392b",
    "#1f9d55",
    "#8e44ad",
    "#d68910",
    "#17a2b8",
    "#6b7385",
    "#e67e22",
    "#34495e",
    "#16a085",
]


def sweep_figure(curves: list[SweepCurve], scope: str) -> dict[str, Any]:
    """Greedy success per policy version on `scope`, one line per sweep member (its grid
    values and seed), each point with its 95% interval."""
    traces = []
    for i, curve in enumerate(curves):
        points = curve.versions.get(scope) or []
        color = SWEEP_COLORS[i % len(SWEEP_COLORS)]
        traces.append(
            _success_line(
                f"#{curve.member.run_id} {curve.label}",
                points,
                color=color,
                tag=f"#{curve.member.run_id}",
            )
        )
    return _fig(
        f"Greedy success per policy version on the {EvalScope(scope).label} (95% interval)",
        [t for t in traces if t["x"]],
        xaxis={"title": {"text": "policy version"}, "tickformat": "d", "rangemode": "tozero"},
        yaxis={"range": [0, 1.05], "tickformat": ".0%"},
        margin={"l": 48, "r": 12, "t": 36, "b": 60},
        legend={"orientation": "h", "y": -0.32},
    )
