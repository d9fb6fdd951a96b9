"""Small SVGs the pages draw server-side: a reward histogram, a sparkline, and an action
drawn onto its screenshot in screen-pixel coordinates (`action_overlay_svg`)."""

from __future__ import annotations

import math
from typing import Any

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe


def reward_histogram_svg(
    bins: list[Any], *, query: str, selected: tuple[float | None, float | None], height: int = 90
) -> SafeString:
    """The reward histogram of the trajectory list: one bar per bin (`RewardBin`), each a
    link to the list filtered to that bin (`query`: the list's other filters). Every value
    goes through format_html."""
    if not bins:
        return mark_safe("")
    top = max(b.count for b in bins) or 1
    bar_w, gap = 56, 6
    bars = []
    for i, b in enumerate(bins):
        h = max(1.0, (height - 30) * b.count / top) if b.count else 0.0
        x = i * (bar_w + gap)
        on = selected == (b.low, b.high)
        link = f"?{query}&" if query else "?"
        bars.append(
            format_html(
                '<a href="{}reward_min={}&amp;reward_max={}" class="bin{}" data-bin="{}" '
                'aria-label="reward {}: {} trajectories"><rect x="{}" y="{}" width="{}" '
                'height="{}"/><text x="{}" y="{}" class="n">{}</text><text x="{}" y="{}">{}'
                "</text></a>",
                link,
                b.low,
                b.high,
                " selected" if on else "",
                b.label,
                b.label,
                b.count,
                x,
                _f(height - 16 - h),
                bar_w,
                _f(h),
                x + bar_w / 2,
                _f(height - 19 - h),
                b.count,
                x + bar_w / 2,
                height - 3,
                b.label,
            )
        )
    width = len(bins) * (bar_w + gap)
    return format_html(
        '<svg class="histogram" id="reward-histogram" width="{}" height="{}" '
        'viewBox="0 0 {} {}">{}</svg>',
        width,
        height,
        width,
        height,
        format_html_join("", "{}", ((b,) for b in bars)),
    )


def sparkline_svg(values: list[float], *, width: int = 120, height: int = 24) -> SafeString:
    """A tiny inline SVG line of success rates in [0, 1] (empty for no points). Every value
    goes through format_html: nothing stored reaches the page unescaped."""
    if not values:
        return mark_safe("")
    if len(values) == 1:
        values = [values[0], values[0]]
    step = width / (len(values) - 1)
    pts = " ".join(
        f"{i * step:.1f},{height - 2 - max(0.0, min(1.0, float(v))) * (height - 4):.1f}"
        for i, v in enumerate(values)
    )
    return format_html(
        '<svg class="spark" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
        '<polyline fill="none" stroke="#2f6fed" stroke-width="1.5" points="{pts}"/></svg>',
        w=int(width),
        h=int(height),
        pts=pts,
    )


_SCROLL = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}


def _f(value: float) -> str:
    return f"{value:.1f}"


def _number(value: Any) -> int | float | None:
    """A coordinate from a stored action: a finite number, else None (drawn as nothing)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return value


def action_overlay_svg(
    action: dict[str, Any] | None, *, width: int, height: int, uid: str = "0"
) -> SafeString:
    """An SVG (viewBox in screen pixels) to lay over the step's screenshot.

    click/double/right: a ring at (x, y); drag: an arrow from (x, y) to (x2, y2); scroll: an
    arrow from (x, y) in the scroll direction; type/hotkey/finished: the text in a label.
    `uid` makes the arrowhead's id unique on the page (a marker inside a hidden step
    would not render for the visible ones). Stored actions come from uploads too: every
    value is escaped by format_html, and a coordinate that is not a number draws nothing.
    """
    if not action or width <= 0 or height <= 0:
        return mark_safe("")
    head = f"head-{uid}"
    t = action.get("type")
    r = max(4.0, min(width, height) / 30)
    sw = max(1.5, r / 3)
    parts: list[SafeString] = []
    x, y = _number(action.get("x")), _number(action.get("y"))
    x2, y2 = _number(action.get("x2")), _number(action.get("y2"))
    has_point = x is not None and y is not None
    if t in ("click", "left_double", "right_single") and has_point:
        ring = '<circle cx="{x}" cy="{y}" r="{r}" class="ring" stroke-width="{sw}"/>'
        parts.append(format_html(ring, x=x, y=y, r=_f(r), sw=_f(sw)))
        parts.append(format_html('<circle cx="{}" cy="{}" r="{}" class="dot"/>', x, y, _f(sw)))
        if t == "left_double":
            parts.append(format_html(ring, x=x, y=y, r=_f(r * 1.6), sw=_f(sw)))
    elif t == "drag" and has_point and x2 is not None and y2 is not None:
        parts.append(
            format_html(
                '<line x1="{}" y1="{}" x2="{}" y2="{}" class="arrow" stroke-width="{}" '
                'marker-end="url(#{})"/>',
                x,
                y,
                x2,
                y2,
                _f(sw),
                head,
            )
        )
        parts.append(
            format_html('<circle cx="{}" cy="{}" r="{}" class="dot"/>', x, y, _f(sw * 1.5))
        )
    elif t == "scroll" and has_point:
        assert x is not None and y is not None
        dx, dy = _SCROLL.get(str(action.get("direction", "down")), (0, 1))
        length = min(width, height) / 4
        parts.append(
            format_html(
                '<line x1="{}" y1="{}" x2="{}" y2="{}" class="arrow" '
                'stroke-width="{}" marker-end="url(#{})"/>',
                x,
                y,
                _f(x + dx * length),
                _f(y + dy * length),
                _f(sw),
                head,
            )
        )
    label = None
    if t == "type":
        label = f"type: {action.get('text', '')!r}"
    elif t == "hotkey":
        label = f"hotkey: {action.get('key', '')}"
    elif t in ("finished", "call_user", "wait"):
        label = f"{t}" + (f": {action['text']}" if action.get("text") else "")
    if label:
        fs = max(8.0, height / 18)
        parts.append(
            format_html(
                '<text x="{}" y="{}" font-size="{}" class="label">{}</text>',
                _f(fs / 2),
                _f(height - fs / 2),
                _f(fs),
                label,
            )
        )
    defs = format_html(
        '<defs><marker id="{}" markerWidth="6" markerHeight="6" refX="5" refY="3" '
        'orient="auto"><path d="M0,0 L6,3 L0,6 z" class="head"/></marker></defs>',
        head,
    )
    return format_html(
        '<svg class="overlay" viewBox="0 0 {} {}" preserveAspectRatio="none" '
        'data-action="{}">{}{}</svg>',
        int(width),
        int(height),
        str(t),
        defs,
        format_html_join("", "{}", ((p,) for p in parts)),
    )
