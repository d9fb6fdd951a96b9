"""The one environment protocol every backend implements, and the data that crosses it.

`Action` covers the whole UI-TARS-1.5 action set with coordinates in *screen* pixels
(the rollout layer maps model-image coordinates to screen pixels before building one).
Backends either perform an action or raise `ActionNotSupported` naming the action and why.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class EnvError(Exception):
    """Base class of environment failures; the message says what failed and where."""


class EnvUnavailable(EnvError):
    """The environment cannot serve (browser or X server died, a call timed out).

    The slot recreates the environment; the current trajectory ends as `error`.
    """


class ActionNotSupported(EnvError):
    """A backend cannot perform this action (e.g. a hotkey it does not know)."""


# Every backend types one key event a character: a desktop ~5 ms each (xdotool, pyautogui),
# where a longer text would outlast the step timeout and take the desktop down with it; a
# browser ~1 ms each, a slot held for seconds on text no task field wants.
MAX_TYPE_CHARS = 1000


def typed_text(action: Action) -> str:
    """The text of a `type` action, as any backend may type it. Raises ActionNotSupported
    over MAX_TYPE_CHARS characters."""
    text = action.text or ""
    if len(text) > MAX_TYPE_CHARS:
        raise ActionNotSupported(
            f"type: {len(text)} characters; at most {MAX_TYPE_CHARS} in one action"
        )
    return text


def desktop_text(action: Action) -> str:
    """The text of a `type` action, as a desktop may type it. Raises ActionNotSupported
    naming the limit it breaks: over MAX_TYPE_CHARS characters, or one no keyboard types."""
    text = typed_text(action)
    untypable = untypable_character(text)
    if untypable:
        raise ActionNotSupported(f"type: {untypable} cannot be typed on a desktop")
    return text


def untypable_character(text: str) -> str:
    """The first character of `text` no keyboard types, named ("U+0007 (BEL)"), or "".
    Control characters other than newline and tab (a keyboard's Return and Tab) have no
    key; every other character, in any script, is typed through a keysym of its own."""
    for ch in text:
        if ch in "\n\t":
            continue
        if unicodedata.category(ch) in ("Cc", "Cs", "Cn") or ch in "\u2028\u2029":
            name = unicodedata.name(ch, "") or _CONTROL_NAMES.get(ord(ch), "unassigned")
            return f"U+{ord(ch):04X} ({name})"
    return ""


_CONTROL_NAMES = {
    0x00: "NUL",
    0x07: "BEL",
    0x08: "BACKSPACE",
    0x0D: "CARRIAGE RETURN",
    0x1B: "ESCAPE",
    0x7F: "DELETE",
}


def hotkey_parts(
    *, key: str, names: dict[str, str], single: Callable[[str], bool], known: str
) -> list[str]:
    """'ctrl shift t' -> each key in a backend's spelling: a name from `names` (lower case),
    or one character that `single` accepts; ActionNotSupported names the unknown key and
    what is `known` besides the names."""
    parts = []
    for raw in key.replace("+", " ").split():
        if raw.lower() in names:
            parts.append(names[raw.lower()])
        elif len(raw) == 1 and single(raw):
            parts.append(raw)
        else:
            raise ActionNotSupported(
                f"hotkey {key!r}: unknown key {raw!r} (known: {known} and "
                f"{', '.join(sorted(names))})"
            )
    return parts


class ActionType(StrEnum):
    CLICK = "click"
    LEFT_DOUBLE = "left_double"
    RIGHT_SINGLE = "right_single"
    DRAG = "drag"
    HOTKEY = "hotkey"
    TYPE = "type"
    SCROLL = "scroll"
    WAIT = "wait"
    FINISHED = "finished"
    CALL_USER = "call_user"


POINT_ACTIONS = frozenset(
    {ActionType.CLICK, ActionType.LEFT_DOUBLE, ActionType.RIGHT_SINGLE, ActionType.SCROLL}
)
SCROLL_DIRECTIONS = ("up", "down", "left", "right")


@dataclass(frozen=True)
class Action:
    """One GUI action. Which fields are required depends on `type` (checked on creation).

    - click / left_double / right_single: x, y
    - drag: x, y (start) and x2, y2 (end)
    - hotkey: key, e.g. "ctrl c" or "enter" (space-separated keys pressed together)
    - type: text (may end with "\\n" to submit)
    - scroll: x, y and direction (up/down/left/right)
    - wait, call_user: nothing; finished: optional text
    """

    type: ActionType
    x: int | None = None
    y: int | None = None
    x2: int | None = None
    y2: int | None = None
    key: str | None = None
    text: str | None = None
    direction: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", ActionType(self.type))
        # Checked here, so every boundary (model output, uploads, stored steps) gets it: a
        # coordinate that is not an integer once reached an SVG unescaped.
        for name in ("x", "y", "x2", "y2"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("key", "text", "direction"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
        t = self.type
        if (t in POINT_ACTIONS or t == ActionType.DRAG) and (self.x is None or self.y is None):
            raise ValueError(f"{t.value} needs x and y")
        if t == ActionType.DRAG and (self.x2 is None or self.y2 is None):
            raise ValueError("drag needs an end point x2, y2")
        if t == ActionType.HOTKEY and not (self.key and self.key.strip()):
            raise ValueError("hotkey needs a key, e.g. 'ctrl c'")
        if t == ActionType.TYPE and self.text is None:
            raise ValueError("type needs text")
        if t == ActionType.SCROLL and self.direction not in SCROLL_DIRECTIONS:
            raise ValueError(
                f"scroll direction must be one of {SCROLL_DIRECTIONS}, got {self.direction!r}"
            )

    @property
    def ends_episode(self) -> bool:
        return self.type in (ActionType.FINISHED, ActionType.CALL_USER)

    def to_json(self) -> dict[str, Any]:
        """The action as a JSON-able dict without empty fields (stored on each Step)."""
        out: dict[str, Any] = {"type": self.type.value}
        for name in ("x", "y", "x2", "y2", "key", "text", "direction"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Action:
        unknown = set(data) - {"type", "x", "y", "x2", "y2", "key", "text", "direction"}
        if unknown:
            raise ValueError(f"unknown action fields: {sorted(unknown)}")
        if "type" not in data:
            raise ValueError("an action needs a 'type'")
        if not isinstance(data["type"], str) or data["type"] not in ActionType._value2member_map_:
            known = ", ".join(t.value for t in ActionType)
            raise ValueError(f"type must be one of {known}, got {data['type']!r}")
        return cls(**data)


@dataclass(frozen=True)
class TaskSpec:
    """What a backend needs to set a task up; built from a `datamanager.Task` row."""

    name: str
    env_kind: str
    env_config: dict[str, Any] = field(default_factory=dict)
    instruction: str = ""
    seed: int | None = None


@dataclass(frozen=True)
class Observation:
    """What the agent sees after a reset or a step."""

    screenshot_png: bytes
    width: int
    height: int
    instruction: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # The environment ended the episode itself (a MiniWoB++ task is over once its target is
    # clicked or its one chance is spent): the runner stops asking the policy and evaluates.
    done: bool = False


@dataclass(frozen=True)
class Evaluation:
    """The task's own verdict. reward is in [0, 1]."""

    reward: float
    success: bool
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1], got {self.reward}")


class Env(Protocol):
    """A long-lived GUI environment, reset in place between episodes.

    Methods raise `EnvUnavailable` when the underlying browser/desktop is gone or a call
    timed out, and `ActionNotSupported` for an action the backend cannot map.
    """

    kind: str

    def reset(self, task: TaskSpec) -> Observation: ...

    def step(self, action: Action) -> Observation: ...

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        """The task's verdict on the current state. `ended_by`: the action the policy ended
        the episode with (finished / call_user; the runner never steps those), for backends
        whose verdict depends on it (OSWorld's infeasible tasks); others ignore it."""
        ...

    def close(self) -> None: ...
