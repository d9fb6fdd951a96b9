"""Figure builders: Plotly figure JSON (plain dicts plotly.js renders) and small SVGs.

Plotly's Python `graph_objects` would validate the same dicts at a cost of milliseconds per
trace; the chart endpoint refreshes every few seconds, so the dicts are built directly.
`action_overlay_svg` draws an action onto its screenshot in screen-pixel coordinates.
"""

from __future__ import annotations

from html import escape
from typing import Any

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


def run_figures(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """All run-page charts from `dartboard.viewmodels.chart_data`."""
    rate_axis = {"range": [0, 1.05], "tickformat": ".0%"}
    success = (
        [
            _line(
                "overall",
                [p["t"] for p in data["success"]],
                [p["rate"] for p in data["success"]],
                line={"width": 3},
            )
        ]
        if data["success"]
        else []
    )
    for i, (task, points) in enumerate(sorted(data["per_task"].items())):
        success.append(
            _line(
                task,
                [t for t, _ in points],
                [r for _, r in points],
                visible=True if i < 8 else "legendonly",
                line={"width": 1},
            )
        )
    budget, cap = [], []
    for i, (task, h) in enumerate(sorted(data["history"].items())):
        vis = True if i < 8 else "legendonly"
        budget.append(_line(task, h["t"], h["budget"], line={"shape": "hv"}, visible=vis))
        cap.append(_line(task, h["t"], h["step_cap"], line={"shape": "hv"}, visible=vis))
    tp = data["throughput"]
    throughput = (
        [
            _line("actions/min", tp["t"], tp["actions_per_min"]),
            _line("trajectories/min", tp["t"], tp["trajectories_per_min"], yaxis="y2"),
        ]
        if tp["t"]
        else []
    )
    util = data["utilisation"]
    utilisation = [
        trace
        for trace in (
            _line(f"env ({util['slots']} slots)", util["env"]["t"], util["env"]["share"]),
            _line("trainer", util["trainer"]["t"], util["trainer"]["share"]),
        )
        if trace["x"]
    ]
    upd = data["updates"]
    wanted = (
        "loss",
        "pg_loss",
        "kl",
        "bc_loss",
        "mean_entropy",
        "clip_fraction",
        "is_weight_mean",
        "kept_step_fraction",
    )
    training = [
        _line(k, upd["number"], upd["series"][k], visible=True if k in wanted[:4] else "legendonly")
        for k in [
            *[k for k in wanted if k in upd["series"]],
            *[k for k in upd["series"] if k not in wanted],
        ]
    ]
    stale = upd["staleness"]
    keys = sorted(stale, key=lambda k: (len(k), k))
    staleness = (
        [{"type": "bar", "x": keys, "y": [stale[k] for k in keys], "name": "steps"}]
        if stale
        else []
    )
    return {
        "success": _fig("Success rate", success, yaxis=rate_axis),
        "budget": _fig("Rollout budget per task", budget, yaxis={"rangemode": "tozero"}),
        "step_cap": _fig("Step cap per task", cap, yaxis={"rangemode": "tozero"}),
        "throughput": _fig(
            "Throughput",
            throughput,
            yaxis={"title": {"text": "actions/min"}, "rangemode": "tozero"},
            yaxis2={
                "title": {"text": "trajectories/min"},
                "overlaying": "y",
                "side": "right",
                "rangemode": "tozero",
            },
        ),
        "utilisation": _fig("Utilisation (busy share)", utilisation, yaxis=rate_axis),
        "training": _fig(
            "Training metrics per update", training, xaxis={"title": {"text": "update"}}
        ),
        "staleness": _fig(
            f"Staleness of the latest update (policy v{upd['latest_version']})"
            if stale
            else "Staleness of the latest update",
            staleness,
            xaxis={"title": {"text": "versions behind"}, "type": "category"},
        ),
    }


def sparkline_svg(values: list[float], *, width: int = 120, height: int = 24) -> str:
    """A tiny inline SVG line of success rates in [0, 1] (empty string for no points)."""
    if not values:
        return ""
    if len(values) == 1:
        values = [values[0], values[0]]
    step = width / (len(values) - 1)
    pts = " ".join(
        f"{i * step:.1f},{height - 2 - max(0.0, min(1.0, v)) * (height - 4):.1f}"
        for i, v in enumerate(values)
    )
    return (
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
        f'<polyline fill="none" stroke="#2f6fed" stroke-width="1.5" points="{pts}"/></svg>'
    )


_SCROLL = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}


def action_overlay_svg(
    action: dict[str, Any] | None, *, width: int, height: int, uid: str = "0"
) -> str:
    """An SVG (viewBox in screen pixels) to lay over the step's screenshot.

    click/double/right: a ring at (x, y); drag: an arrow from (x, y) to (x2, y2); scroll: an
    arrow from (x, y) in the scroll direction; type/hotkey/finished: the text in a label.
    `uid` makes the arrowhead's id unique on the page (a marker inside a hidden step
    would not render for the visible ones).
    """
    head = f"head-{escape(uid)}"
    if not action or width <= 0 or height <= 0:
        return ""
    t = action.get("type")
    r = max(4.0, min(width, height) / 30)
    sw = max(1.5, r / 3)
    parts: list[str] = []
    x, y = action.get("x"), action.get("y")
    if t in ("click", "left_double", "right_single") and x is not None:
        parts.append(
            f'<circle cx="{x}" cy="{y}" r="{r:.1f}" class="ring" stroke-width="{sw:.1f}"/>'
        )
        parts.append(f'<circle cx="{x}" cy="{y}" r="{sw:.1f}" class="dot"/>')
        if t == "left_double":
            parts.append(
                f'<circle cx="{x}" cy="{y}" r="{r * 1.6:.1f}" class="ring" stroke-width="{sw:.1f}"/>'
            )
    elif t == "drag" and x is not None:
        parts.append(
            f'<line x1="{x}" y1="{y}" x2="{action["x2"]}" y2="{action["y2"]}" class="arrow" '
            f'stroke-width="{sw:.1f}" marker-end="url(#{head})"/>'
        )
        parts.append(f'<circle cx="{x}" cy="{y}" r="{sw * 1.5:.1f}" class="dot"/>')
    elif t == "scroll" and x is not None:
        assert y is not None, "a scroll action has both x and y (Action.__post_init__)"
        dx, dy = _SCROLL.get(action.get("direction", "down"), (0, 1))
        length = min(width, height) / 4
        parts.append(
            f'<line x1="{x}" y1="{y}" x2="{x + dx * length:.1f}" y2="{y + dy * length:.1f}" '
            f'class="arrow" stroke-width="{sw:.1f}" marker-end="url(#{head})"/>'
        )
    label = None
    if t == "type":
        label = f"type: {action.get('text', '')!r}"
    elif t == "hotkey":
        label = f"hotkey: {action.get('key', '')}"
    elif t in ("finished", "call_user", "wait"):
        label = t + (f": {action['text']}" if action.get("text") else "")
    if label:
        fs = max(8.0, height / 18)
        parts.append(
            f'<text x="{fs / 2:.1f}" y="{height - fs / 2:.1f}" font-size="{fs:.1f}" '
            f'class="label">{escape(label)}</text>'
        )
    defs = (
        f'<defs><marker id="{head}" markerWidth="6" markerHeight="6" refX="5" refY="3" '
        'orient="auto"><path d="M0,0 L6,3 L0,6 z" class="head"/></marker></defs>'
    )
    return (
        f'<svg class="overlay" viewBox="0 0 {width} {height}" preserveAspectRatio="none" '
        f'data-action="{escape(str(t))}">{defs}{"".join(parts)}</svg>'
    )


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
