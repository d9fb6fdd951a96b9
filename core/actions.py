"""The UI-TARS-1.5 action grammar: parse model output, format canonical text, map coordinates.

A model turn reads::

    Thought: I will open the search box.
    Action: click(start_box='<|box_start|>(235,512)<|box_end|>')

`parse_output` turns such text into a `ParsedOutput` whose `action` (an
`core.protocol.Action`) still holds MODEL-image coordinates; `to_screen` maps them to
screen pixels. `format_action` writes the canonical text (demos, SFT targets) so that
``parse_output(format_action(a)).action == a`` for every valid action. Any malformed text
raises `ActionParseError` with a message saying exactly what was wrong, and nothing else.

Coordinates: everything about how a point is written and what its numbers mean lives in the
"Coordinates" section below (`CoordSpace`, `format_point`, `parse_point`, `to_screen`,
`from_screen`). Two spaces are supported:

- ``"pixel"`` (default, UI-TARS-1.5): pixels of the image the model saw, i.e. the screenshot
  resized by the policy's processor (`core.imaging.ImageGeometry.model_size`).
- ``"relative1000"`` (UI-TARS-1.0): 0..999 fractions of the width/height (1000 is accepted as
  the far edge).

Run the tests with ``.venv/bin/pytest -p no:django tests/core/test_actions.py -q``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from core.imaging import ImageGeometry
from core.protocol import SCROLL_DIRECTIONS, Action, ActionType


class ActionParseError(ValueError):
    """The model's text is not a valid action; the message says what was wrong."""


@dataclass(frozen=True)
class ParsedOutput:
    """One parsed model turn.

    `action` coordinates are in MODEL-image space (see `to_screen`); `action_text` is the
    call as the model wrote it, e.g. ``click(start_box='(10,20)')``.
    """

    thought: str
    action: Action
    action_text: str


# ---------------------------------------------------------------------------------------------
# Coordinates: the one place that decides how a point is written and what its numbers mean

CoordSpace = Literal["pixel", "relative1000"]
COORD_SPACES: tuple[str, ...] = ("pixel", "relative1000")
RELATIVE_SCALE = 1000
"""relative1000 coordinates are written 0..999; 1000 is accepted as the far edge."""
_MAX_DIGITS = 9
_BOX_TOKENS = ("<|box_start|>", "<|box_end|>", "<point>", "</point>")
_INT_RE = re.compile(r"[+-]?[0-9]+")


def _check_space(coords: str) -> None:
    if coords not in COORD_SPACES:
        raise ValueError(f"coords must be one of {COORD_SPACES}, got {coords!r}")


def format_point(x: int, y: int, *, coords: CoordSpace = "pixel") -> str:
    """A point as UI-TARS-1.5 writes it: ``<|box_start|>(x,y)<|box_end|>``.

    Raises ValueError for coordinates `parse_point` would reject (negative, not int, or
    above 1000 for relative1000): such an action cannot round-trip.
    """
    _check_space(coords)
    for value in (x, y):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"cannot format point ({x!r},{y!r}): coordinates must be ints >= 0")
        if len(str(value)) > _MAX_DIGITS or (coords == "relative1000" and value > RELATIVE_SCALE):
            raise ValueError(
                f"cannot format point ({x},{y}): out of range for {coords} coordinates"
            )
    return f"<|box_start|>({x},{y})<|box_end|>"


def parse_point(value: str, *, coords: CoordSpace = "pixel") -> tuple[int, int]:
    """Parse ``(x,y)``, ``[x,y]``, ``<point>x y</point>`` or a box ``[x1,y1,x2,y2]`` (its centre).

    `<|box_start|>`/`<|box_end|>` around the numbers are optional. A box centre is
    ``((x1 + x2) // 2, (y1 + y2) // 2)``.
    """
    _check_space(coords)
    inner = value
    for token in _BOX_TOKENS:
        inner = inner.replace(token, "")
    inner = inner.strip()
    body = inner
    if body.startswith(("(", "[")) and body.endswith((")", "]")):
        body = body[1:-1]
    parts = [p.strip() for p in (body.split(",") if "," in body else body.split())]
    if len(parts) not in (2, 4):
        raise ActionParseError(f"coordinates {inner!r} need 2 numbers (x,y) or 4 (x1,y1,x2,y2)")
    if not all(_INT_RE.fullmatch(p) for p in parts):
        raise ActionParseError(f"coordinates {inner!r} are not integers")
    if any(len(p.lstrip("+-")) > _MAX_DIGITS for p in parts):
        raise ActionParseError(f"coordinates {inner!r} are out of range")
    nums = [int(p) for p in parts]
    if any(n < 0 for n in nums):
        raise ActionParseError(f"coordinates {inner!r} are negative")
    if coords == "relative1000" and any(n > RELATIVE_SCALE for n in nums):
        raise ActionParseError(
            f"coordinates {inner!r} are outside 0..{RELATIVE_SCALE} (relative1000 coordinates)"
        )
    if len(nums) == 4:
        return (nums[0] + nums[2]) // 2, (nums[1] + nums[3]) // 2
    return nums[0], nums[1]


def _scale(value: int, *, num: int, den: int, limit: int) -> int:
    """round(value * num / den) (half up, exact integer arithmetic), clamped to [0, limit - 1]."""
    scaled = (2 * value * num + den) // (2 * den)
    return min(max(scaled, 0), limit - 1)


def _model_extent(coords: str, model_size: tuple[int, int] | None) -> tuple[int, int]:
    _check_space(coords)
    if coords == "relative1000":
        return RELATIVE_SCALE, RELATIVE_SCALE
    if model_size is None:
        raise ValueError("pixel coordinates need model_size=(width, height) of the model image")
    if model_size[0] <= 0 or model_size[1] <= 0:
        raise ValueError(f"model_size must be positive, got {model_size}")
    return model_size


def _map_points(action: Action, map_xy: Callable[[int, int], tuple[int, int]]) -> Action:
    fields = {name: getattr(action, name) for name in ("key", "text", "direction")}
    if action.x is not None and action.y is not None:
        fields["x"], fields["y"] = map_xy(action.x, action.y)
    if action.x2 is not None and action.y2 is not None:
        fields["x2"], fields["y2"] = map_xy(action.x2, action.y2)
    return Action(type=action.type, **fields)


def to_screen(
    action: Action,
    *,
    screen_size: tuple[int, int],
    model_size: tuple[int, int] | None = None,
    coords: CoordSpace = "pixel",
) -> Action:
    """Map an action's model-space coordinates to screen pixels, clamped to the screen.

    Sizes are ``(width, height)``. `model_size` is the model image (`ImageGeometry.model_size`);
    relative1000 coordinates do not need it. Actions without coordinates come back unchanged.
    """
    mw, mh = _model_extent(coords, model_size)
    sw, sh = screen_size
    if sw <= 0 or sh <= 0:
        raise ValueError(f"screen_size must be positive, got {screen_size}")
    return _map_points(
        action,
        lambda x, y: (_scale(x, num=sw, den=mw, limit=sw), _scale(y, num=sh, den=mh, limit=sh)),
    )


def from_screen(
    action: Action,
    *,
    screen_size: tuple[int, int],
    model_size: tuple[int, int] | None = None,
    coords: CoordSpace = "pixel",
) -> Action:
    """The inverse of `to_screen` (up to rounding): screen pixels -> model space, for demos."""
    mw, mh = _model_extent(coords, model_size)
    sw, sh = screen_size
    if sw <= 0 or sh <= 0:
        raise ValueError(f"screen_size must be positive, got {screen_size}")
    return _map_points(
        action,
        lambda x, y: (_scale(x, num=mw, den=sw, limit=mw), _scale(y, num=mh, den=sh, limit=mh)),
    )


# ---------------------------------------------------------------------------------------------
# Grammar

# name -> (required arguments, optional arguments)
_SPECS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "click": (("start_box",), ()),
    "left_double": (("start_box",), ()),
    "right_single": (("start_box",), ()),
    "drag": (("start_box", "end_box"), ()),
    "hotkey": (("key",), ()),
    "type": (("content",), ()),
    "scroll": (("start_box", "direction"), ()),
    "wait": ((), ()),
    "finished": ((), ("content",)),
    "call_user": ((), ()),
}
# Argument spellings other UI-TARS versions use.
_ALIASES = {"start_point": "start_box", "point": "start_box", "end_point": "end_box"}
_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "t": "\t", "r": "\r"}
_QUOTE = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_ACTION_LINE_RE = re.compile(r"^[ \t]*Action:", re.MULTILINE)
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WS_RE = re.compile(r"\s*")
# A quote closes a string only before ")", ", name=" or the end: an unescaped ' in content
# ("it's") is then read as text, as UI-TARS's own parser does.
_CLOSES_RE = re.compile(r"\s*(?:\)|,\s*(?:\)|[A-Za-z_][A-Za-z0-9_]*\s*=)|\Z)")


def _snippet(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def split_output(text: str) -> tuple[str, str | None]:
    """Split model text into ``(thought, action_text)``; action_text is None without an Action line.

    The action starts at the first line beginning with ``Action:``; everything before it,
    minus an optional leading ``Thought:``, is the thought (stripped).
    """
    match = _ACTION_LINE_RE.search(text)
    head = text if match is None else text[: match.start()]
    thought = head.strip()
    if thought.startswith("Thought:"):
        thought = thought[len("Thought:") :].strip()
    if match is None:
        return thought, None
    return thought, text[match.end() :].strip()


def _skip_ws(text: str, pos: int) -> int:
    match = _WS_RE.match(text, pos)  # \s* always matches
    return match.end() if match else pos


def _read_quoted(text: str, pos: int, name: str, key: str) -> tuple[str, int]:
    quote, j, out = text[pos], pos + 1, []
    while j < len(text):
        char = text[j]
        if char == "\\" and j + 1 < len(text):
            nxt = text[j + 1]
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
            j += 2
            continue
        if char == quote and _CLOSES_RE.match(text, j + 1):
            return "".join(out), j + 1
        out.append(char)
        j += 1
    raise ActionParseError(f"unterminated string in argument {key!r} of {name}")


def _read_bare(text: str, pos: int, name: str, key: str) -> tuple[str, int]:
    """An unquoted value, e.g. start_box=(10,20): up to a top-level ',' or ')'."""
    depth, j = 0, pos
    while j < len(text):
        char = text[j]
        if char in "([":
            depth += 1
        elif char in ")]":
            if depth == 0:
                break
            depth -= 1
        elif char == "," and depth == 0:
            break
        j += 1
    value = text[pos:j].strip()
    if not value:
        raise ActionParseError(f"argument {key!r} of {name} has no value")
    return value, j


def _parse_call(call: str) -> tuple[str, list[tuple[str, str]]]:
    """``name(key='value', ...)`` -> (name, [(key, decoded value), ...])."""
    if not call:
        raise ActionParseError("empty action after 'Action:'")
    match = _NAME_RE.match(call)
    if match is None:
        raise ActionParseError(
            f"action {_snippet(call)} is not a call like click(start_box='(x,y)')"
        )
    name = match.group()
    if name not in _SPECS:
        raise ActionParseError(f"unknown action {name!r}")
    pos = _skip_ws(call, match.end())
    if pos >= len(call) or call[pos] != "(":
        raise ActionParseError(f"{name} needs '(' after its name")
    pos += 1
    args: list[tuple[str, str]] = []
    while True:
        pos = _skip_ws(call, pos)
        if pos >= len(call):
            raise ActionParseError(f"missing ')' at the end of {name}(...)")
        if call[pos] == ")":
            pos += 1
            break
        key_match = _NAME_RE.match(call, pos)
        eq = _skip_ws(call, key_match.end()) if key_match else pos
        if key_match is None or eq >= len(call) or call[eq] != "=":
            raise ActionParseError(
                f"{name} arguments must be name='value', got {_snippet(call[pos:])}"
            )
        key = key_match.group()
        pos = _skip_ws(call, eq + 1)
        if pos < len(call) and call[pos] in "'\"":
            value, pos = _read_quoted(call, pos, name, key)
        else:
            value, pos = _read_bare(call, pos, name, key)
        args.append((key, value))
        pos = _skip_ws(call, pos)
        if pos >= len(call):
            raise ActionParseError(f"missing ')' at the end of {name}(...)")
        if call[pos] == ",":
            pos += 1
        elif call[pos] == ")":
            pos += 1
            break
        else:
            raise ActionParseError(
                f"expected ',' or ')' after argument {key!r} of {name}, got {_snippet(call[pos:])}"
            )
    rest = call[pos:].strip()
    if rest:
        raise ActionParseError(f"unexpected text after the action: {_snippet(rest)}")
    return name, args


def _build_action(name: str, args: list[tuple[str, str]], coords: CoordSpace) -> Action:
    required, optional = _SPECS[name]
    values: dict[str, str] = {}
    for raw_key, value in args:
        key = _ALIASES.get(raw_key, raw_key)
        if key not in required and key not in optional:
            raise ActionParseError(f"{name} got an unexpected argument {raw_key!r}")
        if key in values:
            raise ActionParseError(f"{name} got argument {key!r} twice")
        values[key] = value
    for key in required:
        if key not in values:
            raise ActionParseError(f"{name} needs {key}")
    fields: dict[str, Any] = {}
    if "start_box" in values:
        fields["x"], fields["y"] = parse_point(values["start_box"], coords=coords)
    if "end_box" in values:
        fields["x2"], fields["y2"] = parse_point(values["end_box"], coords=coords)
    if "key" in values:
        if not values["key"].strip():
            raise ActionParseError("hotkey needs a non-empty key, e.g. key='ctrl c'")
        fields["key"] = values["key"]
    if "content" in values:
        fields["text"] = values["content"]
    if "direction" in values:
        direction = values["direction"].strip().lower()
        if direction not in SCROLL_DIRECTIONS:
            raise ActionParseError(
                f"scroll direction must be one of {', '.join(SCROLL_DIRECTIONS)}, "
                f"got {values['direction']!r}"
            )
        fields["direction"] = direction
    try:
        return Action(type=ActionType(name), **fields)
    except ValueError as error:  # Action's own checks; the grammar above should catch all
        raise ActionParseError(str(error)) from error


def parse_output(text: str, *, coords: CoordSpace = "pixel") -> ParsedOutput:
    """Parse one model turn; raises only `ActionParseError` on malformed text.

    Coordinates in the result are model-space (see `to_screen`).
    """
    _check_space(coords)
    thought, action_text = split_output(text)
    if action_text is None:
        raise ActionParseError("no 'Action:' line")
    name, args = _parse_call(action_text)
    return ParsedOutput(
        thought=thought, action=_build_action(name, args, coords), action_text=action_text
    )


def _quote(text: str) -> str:
    return "'" + "".join(_QUOTE.get(char, char) for char in text) + "'"


_FIELDS_USED: dict[ActionType, frozenset[str]] = {
    ActionType.CLICK: frozenset({"x", "y"}),
    ActionType.LEFT_DOUBLE: frozenset({"x", "y"}),
    ActionType.RIGHT_SINGLE: frozenset({"x", "y"}),
    ActionType.DRAG: frozenset({"x", "y", "x2", "y2"}),
    ActionType.HOTKEY: frozenset({"key"}),
    ActionType.TYPE: frozenset({"text"}),
    ActionType.SCROLL: frozenset({"x", "y", "direction"}),
    ActionType.WAIT: frozenset(),
    ActionType.FINISHED: frozenset({"text"}),
    ActionType.CALL_USER: frozenset(),
}


def format_action_call(action: Action, *, coords: CoordSpace = "pixel") -> str:
    """The canonical call text, e.g. ``click(start_box='<|box_start|>(10,20)<|box_end|>')``.

    Raises ValueError for an action that would not round-trip: fields its type does not
    use, or coordinates `format_point` rejects.
    """
    extra = sorted(
        name
        for name in ("x", "y", "x2", "y2", "key", "text", "direction")
        if getattr(action, name) is not None and name not in _FIELDS_USED[action.type]
    )
    if extra:
        raise ValueError(f"{action.type.value} does not use field(s) {extra}")
    t = action.type
    # Action.__post_init__ guarantees the points, key and text each type below needs.
    start = end = ""
    if action.x is not None and action.y is not None:
        start = format_point(action.x, action.y, coords=coords)
    if action.x2 is not None and action.y2 is not None:
        end = format_point(action.x2, action.y2, coords=coords)
    if t == ActionType.DRAG:
        return f"drag(start_box='{start}', end_box='{end}')"
    if t == ActionType.SCROLL:
        return f"scroll(start_box='{start}', direction='{action.direction}')"
    if start:
        return f"{t.value}(start_box='{start}')"
    if t == ActionType.HOTKEY:
        return f"hotkey(key={_quote(action.key or '')})"
    if action.text is not None:  # type, or finished with an answer
        return f"{t.value}(content={_quote(action.text)})"
    return f"{t.value}()"


def format_action(action: Action, *, thought: str = "", coords: CoordSpace = "pixel") -> str:
    """``Thought: ...\\nAction: ...`` (no Thought line when `thought` is blank).

    `thought` is written stripped; it must not contain a line starting with ``Action:``
    (the parser would take that line for the action), else ValueError.
    """
    call = format_action_call(action, coords=coords)
    thought = thought.strip()
    if not thought:
        return f"Action: {call}"
    head = f"Thought: {thought}"
    if _ACTION_LINE_RE.search(head):
        raise ValueError("thought must not contain a line starting with 'Action:'")
    return f"{head}\nAction: {call}"


def format_screen_action(
    action: Action,
    *,
    screen_size: tuple[int, int],
    geometry: ImageGeometry,
    coords: CoordSpace = "pixel",
    thought: str = "",
) -> str:
    """The text a model whose processor has `geometry` writes for this screen-space action
    (the oracle's answers, its stored demos and imported demonstrations): model coordinates,
    canonical form. The oracle gives no thought (the shipped policy was pretrained to answer
    with the action alone, so demos in that format warm-start it without a format shift); a
    thought that would not parse back (a line of it starting with "Action:") is left out."""
    width, height = screen_size
    model_size = geometry.model_size(width=width, height=height)
    model_action = from_screen(
        action, screen_size=screen_size, model_size=model_size, coords=coords
    )
    try:
        return format_action(model_action, thought=thought, coords=coords)
    except ValueError:
        return format_action(model_action, coords=coords)
