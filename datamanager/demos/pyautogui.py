"""Pyautogui code, as OSWorld result folders (`traj.jsonl`'s "action") and AgentNet (each
step's "code") record actions, read into Dartboard `Action`s and written back out.

Reading parses the code with `ast` and evaluates nothing but literal arguments
(`ast.literal_eval`): a recorded step is data from elsewhere, and `__import__('os')` in it
is an error, never a command. One `PyautoguiReader` reads one episode, step after step,
because pyautogui code carries state from step to step: the cursor (moveTo in one step,
click() in the next), a mouse button held from mouseDown to mouseUp, keys held from keyDown
to keyUp.

    .venv/bin/python -c "from datamanager.demos.pyautogui import PyautoguiReader as R; \\
        print(R(scale=(1.0, 1.0), screen=(1920, 1080)).actions('pyautogui.click(10, 20)'))"

Lost on the way in: a scroll's amount (Dartboard's scroll has a direction only), durations,
intervals and sleeps. Errors, since Dartboard has no such action: triple and middle clicks,
a right double click, a drag with another button than the left, a click, scroll or text
while keys are held, anything while a mouse button is held.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, replace
from typing import Any

from core.protocol import Action, ActionType
from envmanager.osworld_actions import SCROLL_CLICKS, pyautogui_keys

MAX_CODE_CHARS = 20_000  # a recorded step is a few calls; far more is not a step
MAX_STATEMENTS = 200
MAX_PRESSES = 100  # press(key, presses=n) gives n hotkeys

# OSWorld's special words, each the whole of a step's code.
_WORDS = {"WAIT": ActionType.WAIT, "DONE": ActionType.FINISHED, "FAIL": ActionType.CALL_USER}


class PyautoguiError(ValueError):
    """Code that does not map to Dartboard actions; the message names the line and the text."""


class _Unmapped(Exception):
    """Why one statement does not map; `PyautoguiReader.actions` adds its line and text."""


# Each call's parameters in pyautogui's own order (0.9.54), so positional arguments bind as
# pyautogui binds them: click(10, 20, 2) is a double click. "*keys" takes every positional.
_CLICK = ("x", "y", "clicks", "interval", "button", "duration", "tween", "logScreenshot", "_pause")
_ONE_CLICK = ("x", "y", "interval", "duration", "tween", "logScreenshot", "_pause")
_DOUBLE_CLICK = ("x", "y", "interval", "button", "duration", "tween", "logScreenshot", "_pause")
_MOVE = ("x", "y", "duration", "tween", "logScreenshot", "_pause")
_MOVE_REL = ("xOffset", "yOffset", "duration", "tween", "logScreenshot", "_pause")
_DRAG = ("x", "y", "duration", "tween", "button", "logScreenshot", "_pause", "mouseDownUp")
_DRAG_REL = ("xOffset", "yOffset", *_DRAG[2:])
_BUTTON = ("x", "y", "button", "duration", "tween", "logScreenshot", "_pause")
_SCROLL = ("clicks", "x", "y", "logScreenshot", "_pause")
_WRITE = ("message", "interval", "logScreenshot", "_pause")
_KEY = ("key", "logScreenshot", "_pause")
_SIGNATURES: dict[str, tuple[str, ...]] = {
    "pyautogui.click": _CLICK,
    "pyautogui.leftClick": _ONE_CLICK,
    "pyautogui.rightClick": _ONE_CLICK,
    "pyautogui.right_click": _ONE_CLICK,
    "pyautogui.doubleClick": _DOUBLE_CLICK,
    "pyautogui.double_click": _DOUBLE_CLICK,
    "pyautogui.moveTo": _MOVE,
    "pyautogui.moveRel": _MOVE_REL,
    "pyautogui.move": _MOVE_REL,
    "pyautogui.dragTo": _DRAG,
    "pyautogui.dragRel": _DRAG_REL,
    "pyautogui.drag": _DRAG_REL,
    "pyautogui.mouseDown": _BUTTON,
    "pyautogui.mouseUp": _BUTTON,
    "pyautogui.scroll": _SCROLL,
    "pyautogui.vscroll": _SCROLL,
    "pyautogui.hscroll": _SCROLL,
    "pyautogui.write": _WRITE,
    "pyautogui.typewrite": _WRITE,
    "pyautogui.press": ("keys", "presses", "interval", "logScreenshot", "_pause"),
    "pyautogui.hotkey": ("*keys", "interval", "logScreenshot", "_pause"),
    "pyautogui.keyDown": _KEY,
    "pyautogui.keyUp": _KEY,
    "pyautogui.sleep": ("seconds",),
    "time.sleep": ("seconds",),
    "computer.wait": ("seconds",),
    "computer.terminate": ("status", "answer"),
}
_NO_ACTION = {
    "tripleClick": "triple click has no Dartboard action",
    "triple_click": "triple click has no Dartboard action",
    "middleClick": "middle click has no Dartboard action",
}
_BUTTONS = {
    "left": "left",
    "primary": "left",
    "right": "right",
    "secondary": "right",
    "middle": "middle",
}
# Characters pyautogui presses as named keys; Action.key spells them by name.
_KEY_CHARACTERS = {" ": "space", "\n": "enter", "\r": "enter", "\t": "tab"}
_STATEMENTS = {
    ast.Assign: "an assignment",
    ast.AugAssign: "an assignment",
    ast.AnnAssign: "an assignment",
    ast.For: "a loop",
    ast.While: "a loop",
    ast.If: "an if",
    ast.FunctionDef: "a def",
    ast.AsyncFunctionDef: "a def",
    ast.ClassDef: "a class",
    ast.With: "a with",
    ast.Try: "a try",
    ast.Expr: "an expression",
}


@dataclass
class _State:
    """What pyautogui code carries from one statement, and step, to the next. Points are in
    the code's own units (AgentNet's fractions), scaled only when an action is made."""

    cursor: tuple[float, float] | None = None
    button: str | None = None  # held by mouseDown: "left" or "right"
    button_at: tuple[float, float] | None = None
    keys: tuple[str, ...] = ()  # held by keyDown, in order
    keys_pressed: bool = False  # a key was pressed since the last keyDown


class PyautoguiReader:
    """Reads one episode's steps of pyautogui code, in order, into Dartboard actions.

    `scale`: multiply the code's coordinates by it for screenshot pixels (OSWorld: screenshot
    size / VM screen size, usually (1.0, 1.0); AgentNet writes fractions of the screen, so its
    scale is the screenshot size). `screen`: the screenshot's (width, height); a point rounds
    to a pixel and must lie on the screenshot (the far edge, AgentNet's 1.0, is the last pixel).

    A scroll keeps only its direction: Dartboard's scroll has no amount (a UI-TARS scroll is
    SCROLL_CLICKS clicks), so scroll(-3) and scroll(-15) both read as a scroll down.
    """

    def __init__(self, *, scale: tuple[float, float], screen: tuple[int, int]) -> None:
        factors = [_finite(s) for s in scale]
        if len(factors) != 2 or not all(f is not None and f > 0 for f in factors):
            raise ValueError(f"scale must be two positive numbers, got {scale!r}")
        if len(screen) != 2 or not all(isinstance(s, int) and s > 0 for s in screen):
            raise ValueError(f"screen must be two positive integers, got {screen!r}")
        self._scale = (float(scale[0]), float(scale[1]))
        self._screen = (screen[0], screen[1])
        self._state = _State()

    def actions(self, code: str) -> list[Action]:
        """One recorded step's code -> its actions, in order. A step that only moves the
        cursor or holds a button or key (moveTo, mouseDown, keyDown) gives [] and passes that
        state on. PyautoguiError when a statement does not map, or when nothing in the code
        acts (only imports and sleeps); the reader's state is then as before the step."""
        word = code.strip()
        if word in _WORDS:
            return [Action(_WORDS[word])]
        if len(code) > MAX_CODE_CHARS:
            raise PyautoguiError(
                f"code of {len(code):,} characters; at most {MAX_CODE_CHARS:,} in one step"
            )
        tree = _parse(code)
        if len(tree.body) > MAX_STATEMENTS:
            raise PyautoguiError(
                f"code of {len(tree.body)} statements; at most {MAX_STATEMENTS} in one step"
            )
        step = _Step(state=replace(self._state), scale=self._scale, screen=self._screen)
        for stmt in tree.body:
            try:
                step.run(stmt)
            except _Unmapped as e:
                text = _shorten(ast.get_source_segment(code, stmt) or "")
                raise PyautoguiError(f"line {stmt.lineno}: {text!r}: {e}") from None
        if not step.acted:
            raise PyautoguiError(f"{_shorten(code)!r}: no pyautogui or computer action in it")
        self._state = step.state
        return step.actions


class _Step:
    """One step's statements run against a copy of the reader's state."""

    def __init__(
        self, *, state: _State, scale: tuple[float, float], screen: tuple[int, int]
    ) -> None:
        self.state = state
        self.scale = scale
        self.screen = screen
        self.actions: list[Action] = []
        self.acted = False  # a call other than a sleep

    def run(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Import):
            if all(a.name in ("pyautogui", "time") and a.asname is None for a in stmt.names):
                return
            raise _Unmapped("only `import pyautogui` and `import time` are read")
        if isinstance(stmt, ast.ImportFrom):
            if stmt.level == 0 and stmt.module in ("pyautogui", "time"):
                return
            raise _Unmapped("only imports from pyautogui and time are read")
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
            what = _STATEMENTS.get(type(stmt), f"a {type(stmt).__name__} statement")
            raise _Unmapped(f"{what} is not a pyautogui call")
        call = stmt.value
        func = call.func
        if not (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in ("pyautogui", "computer", "time")
        ):
            raise _Unmapped("only calls of pyautogui.*, computer.* and time.sleep are read")
        name = f"{func.value.id}.{func.attr}"
        if func.value.id != "time" and func.attr in _NO_ACTION:
            raise _Unmapped(_NO_ACTION[func.attr])
        if name not in _SIGNATURES:
            raise _Unmapped(f"{name}() has no Dartboard action")
        self.call(name, _bind(call, _SIGNATURES[name]))

    def call(self, name: str, args: dict[str, Any]) -> None:
        if name in ("time.sleep", "pyautogui.sleep"):
            return
        self.acted = True
        short = name.partition(".")[2]
        if name == "computer.wait":
            self._emit(Action(ActionType.WAIT))
        elif name == "computer.terminate":
            self._terminate(args.get("status"), args.get("answer"))
        elif short in ("click", "leftClick"):
            clicks = args.get("clicks", 1)
            self._click(args, button=_button(args.get("button", "left")), clicks=clicks)
        elif short in ("rightClick", "right_click"):
            self._click(args, button="right", clicks=1)
        elif short in ("doubleClick", "double_click"):
            self._click(args, button=_button(args.get("button", "left")), clicks=2)
        elif short == "moveTo":
            self._target(args)
        elif short in ("moveRel", "move"):
            self._move(self._relative(args))
        elif short == "dragTo":
            self._drag_to(args)
        elif short in ("dragRel", "drag"):
            self._drag_to({**args, "x": self._relative(args), "y": None})
        elif short == "mouseDown":
            self._mouse_down(args)
        elif short == "mouseUp":
            self._mouse_up(args)
        elif short in ("scroll", "vscroll", "hscroll"):
            self._scroll(args, horizontal=short == "hscroll")
        elif short in ("write", "typewrite"):
            self._write(args.get("message"))
        elif short == "press":
            self._press(args.get("keys"), args.get("presses", 1))
        elif short == "hotkey":
            keys = args.get("keys", [])
            if len(keys) == 1 and isinstance(keys[0], list | tuple):
                keys = keys[0]  # hotkey(['ctrl', 'c']): some data passes one list
            if not keys:
                raise _Unmapped("hotkey() names no key")
            self._hotkey([_key_name(k) for k in keys])
        elif short == "keyDown":
            self._key_down(_key_name(args.get("key")))
        else:
            assert short == "keyUp", name  # _SIGNATURES names nothing else
            self._key_up(_key_name(args.get("key")))

    # Actions ----------------------------------------------------------------------------

    def _emit(self, action: Action) -> None:
        if self.state.button is not None:
            raise _Unmapped(
                f"{action.type.value} while the {self.state.button} button is held by "
                "mouseDown has no Dartboard action"
            )
        if self.state.keys and action.type != ActionType.HOTKEY:
            raise _Unmapped(
                f"{action.type.value} while {' '.join(self.state.keys)} is held by keyDown "
                "has no Dartboard action"
            )
        self.actions.append(action)

    def _terminate(self, status: object, answer: object) -> None:
        if answer is not None and not isinstance(answer, str):
            raise _Unmapped(f"answer must be a string, got {answer!r}")
        if status == "success":
            self._emit(Action(ActionType.FINISHED, text=answer))
        elif status == "failure":
            self._emit(Action(ActionType.CALL_USER))
        else:
            raise _Unmapped(f"status must be 'success' or 'failure', got {status!r}")

    def _click(self, args: dict[str, Any], *, button: str, clicks: object) -> None:
        kind = _click_type(button, clicks)
        x, y = self._pixel(self._target(args))
        self._emit(Action(kind, x=x, y=y))

    def _drag_to(self, args: dict[str, Any]) -> None:
        button = _button(args.get("button", "left"))
        if args.get("mouseDownUp") is False:  # a move while mouseDown holds the button
            self._target(args)
            return
        if button != "left":
            raise _Unmapped(f"a drag with the {button} button has no Dartboard action")
        x, y = self._pixel(self._cursor("a drag starts at the cursor"))
        x2, y2 = self._pixel(self._target(args))
        self._emit(Action(ActionType.DRAG, x=x, y=y, x2=x2, y2=y2))

    def _mouse_down(self, args: dict[str, Any]) -> None:
        if self.state.button is not None:
            raise _Unmapped(f"mouseDown while the {self.state.button} button is already down")
        button = _button(args.get("button", "left"))
        if button == "middle":
            raise _Unmapped("middle click has no Dartboard action")
        self.state.button_at = self._target(args)
        self.state.button = button

    def _mouse_up(self, args: dict[str, Any]) -> None:
        down, down_at = self.state.button, self.state.button_at
        if down is None or down_at is None:
            raise _Unmapped("mouseUp without mouseDown")
        button = _button(args.get("button", "left"))
        if button != down:
            raise _Unmapped(f"mouseUp releases the {button} button; mouseDown held the {down}")
        (x, y), (x2, y2) = self._pixel(down_at), self._pixel(self._target(args))
        self.state.button = self.state.button_at = None
        if (x, y) == (x2, y2):
            self._emit(Action(_click_type(button, 1), x=x, y=y))
        elif button == "right":
            raise _Unmapped("a drag with the right button has no Dartboard action")
        else:
            self._emit(Action(ActionType.DRAG, x=x, y=y, x2=x2, y2=y2))

    def _scroll(self, args: dict[str, Any], *, horizontal: bool) -> None:
        clicks = _number(args.get("clicks"), "clicks")
        if clicks == 0:
            raise _Unmapped("a scroll of 0 clicks scrolls nothing")
        point = self._point(args.get("x"), args.get("y"))
        if point is not None:
            self._move(point)
        if self.state.cursor is not None:
            x, y = self._pixel(self.state.cursor)
        else:
            x, y = self.screen[0] // 2, self.screen[1] // 2
        if horizontal:
            direction = "right" if clicks > 0 else "left"
        else:
            direction = "up" if clicks > 0 else "down"
        self._emit(Action(ActionType.SCROLL, x=x, y=y, direction=direction))

    def _write(self, message: object) -> None:
        if isinstance(message, str):
            if self.state.keys:  # each character is a key pressed with the held ones
                for ch in message:
                    self._hotkey([_key_name(ch)])
            else:
                self._emit(Action(ActionType.TYPE, text=message))
            return
        if not isinstance(message, list | tuple):
            raise _Unmapped(f"write needs a string or a list of keys, got {message!r}")
        text = ""  # typewrite(['a', 'b', 'enter']): characters typed, names pressed
        for item in message:
            if not isinstance(item, str) or not item:
                raise _Unmapped(f"typewrite's list holds characters and key names, got {item!r}")
            if len(item) == 1 and not self.state.keys:
                text += item
                continue
            if text:
                self._emit(Action(ActionType.TYPE, text=text))
                text = ""
            self._hotkey([_key_name(item)])
        if text:
            self._emit(Action(ActionType.TYPE, text=text))

    def _press(self, keys: object, presses: object) -> None:
        names = [keys] if isinstance(keys, str) else keys
        if not isinstance(names, list | tuple) or not names:
            raise _Unmapped(f"press needs a key or a list of keys, got {keys!r}")
        if isinstance(presses, bool) or not isinstance(presses, int):
            raise _Unmapped(f"presses must be an integer, got {presses!r}")
        if not 1 <= presses <= MAX_PRESSES:
            raise _Unmapped(f"presses={presses}; from 1 to {MAX_PRESSES} are read")
        parsed = [_key_name(k) for k in names]
        for _ in range(presses):  # pyautogui presses the whole list each time
            for name in parsed:
                self._hotkey([name])

    def _hotkey(self, names: list[str]) -> None:
        """Keys pressed together, after the keys keyDown holds."""
        held = self.state.keys
        self._emit(
            Action(ActionType.HOTKEY, key=" ".join([*held, *(n for n in names if n not in held)]))
        )
        self.state.keys_pressed = True

    def _key_down(self, name: str) -> None:
        if name not in self.state.keys:
            self.state.keys = (*self.state.keys, name)
        self.state.keys_pressed = False

    def _key_up(self, name: str) -> None:
        if name not in self.state.keys:
            raise _Unmapped(f"keyUp of {name!r} without keyDown")
        if not self.state.keys_pressed:  # keyDown('win'); keyUp('win') presses the key itself
            self._hotkey([])
        self.state.keys = tuple(k for k in self.state.keys if k != name)

    # Points -----------------------------------------------------------------------------

    def _point(self, x: object, y: object) -> tuple[float, float] | None:
        """pyautogui's (x, y) arguments: two numbers, one pair, or none (None); a missing
        one of the two is the cursor's, as pyautogui takes it."""
        if isinstance(x, str):
            raise _Unmapped(f"x {_shorten(x, 40)!r} is an image to locate; only points are read")
        if isinstance(x, list | tuple):
            if y is not None:
                raise _Unmapped("a point given as a pair takes no y")
            if len(x) != 2:
                raise _Unmapped(f"a point needs 2 numbers, got {len(x)}")
            x, y = x
        if x is None and y is None:
            return None
        if x is None or y is None:
            cursor = self._cursor("a point with x or y alone takes the other from the cursor")
            x = cursor[0] if x is None else x
            y = cursor[1] if y is None else y
        return _number(x, "x"), _number(y, "y")

    def _target(self, args: dict[str, Any]) -> tuple[float, float]:
        """The point a call acts at (its own, else the cursor); the cursor moves there."""
        point = self._point(args.get("x"), args.get("y"))
        if point is None:
            point = self._cursor("a call without a point acts at the cursor")
        self._move(point)
        return point

    def _relative(self, args: dict[str, Any]) -> tuple[float, float]:
        """The cursor moved by (xOffset, yOffset), a missing offset being 0."""
        dx, dy = args.get("xOffset"), args.get("yOffset")
        if not isinstance(dx, list | tuple):  # pyautogui reads a missing offset as 0
            dx, dy = (0 if dx is None else dx), (0 if dy is None else dy)
        offset = self._point(dx, dy)
        assert offset is not None  # both given
        cursor = self._cursor("a relative move starts at the cursor")
        return cursor[0] + offset[0], cursor[1] + offset[1]

    def _cursor(self, why: str) -> tuple[float, float]:
        if self.state.cursor is None:
            raise _Unmapped(f"{why}, and no cursor position is known yet")
        return self.state.cursor

    def _move(self, point: tuple[float, float]) -> None:
        self._pixel(point)  # a cursor off the screenshot is an error where it is set
        self.state.cursor = point

    def _pixel(self, point: tuple[float, float]) -> tuple[int, int]:
        pixel = []
        for value, factor, size in zip(point, self.scale, self.screen, strict=True):
            scaled = value * factor
            p = round(scaled) if math.isfinite(scaled) else -1
            if p == size:  # the far edge (AgentNet's 1.0) is the last pixel
                p = size - 1
            if not 0 <= p < size:
                raise _Unmapped(
                    f"point ({point[0]:g}, {point[1]:g}) is outside the "
                    f"{self.screen[0]}x{self.screen[1]} screenshot"
                )
            pixel.append(p)
        return pixel[0], pixel[1]


def _parse(code: str) -> ast.Module:
    try:
        return ast.parse(code)
    except SyntaxError as e:
        if e.lineno is None:  # a NUL character, in later 3.11 releases
            raise PyautoguiError(f"{_shorten(code)!r}: {e.msg}") from None
        line = _shorten((e.text or "").strip())
        raise PyautoguiError(f"line {e.lineno}: {line!r}: syntax error: {e.msg}") from None
    except ValueError as e:  # a NUL character, in earlier ones
        raise PyautoguiError(f"{_shorten(code)!r}: {e}") from None
    except (MemoryError, RecursionError):  # how CPython's parser reports deep nesting
        raise PyautoguiError(f"{_shorten(code)!r}: nested too deeply to read") from None


def _bind(call: ast.Call, params: tuple[str, ...]) -> dict[str, Any]:
    """The call's literal arguments by parameter name; nothing is evaluated but literals."""
    values: dict[str, Any] = {}
    star = params[0] == "*keys"
    for i, node in enumerate(call.args):
        if isinstance(node, ast.Starred):
            raise _Unmapped("*arguments are not read")
        if star:
            values.setdefault("keys", []).append(_literal(node, f"argument {i + 1}"))
        elif i < len(params):
            values[params[i]] = _literal(node, params[i])
        else:
            raise _Unmapped(f"more than {len(params)} positional arguments")
    for kw in call.keywords:
        if kw.arg is None:
            raise _Unmapped("**arguments are not read")
        if kw.arg not in params or kw.arg.startswith("*"):
            raise _Unmapped(f"unknown argument {kw.arg!r}")
        if kw.arg in values:
            raise _Unmapped(f"argument {kw.arg!r} given twice")
        values[kw.arg] = _literal(kw.value, kw.arg)
    return values


def _literal(node: ast.expr, name: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise _Unmapped(
            f"{name} is not a literal (a number, a string, or a list of them)"
        ) from None


def _finite(value: object) -> float | None:
    """`value` as a finite float, or None when it is no number (a bool is none) or not finite."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        return None
    return number if math.isfinite(number) else None


def _number(value: object, name: str) -> float:
    number = _finite(value)
    if number is None:
        raise _Unmapped(f"{name} must be a finite number, got {_shorten(repr(value), 40)}")
    return number


def _button(value: object) -> str:
    if not isinstance(value, str) or value.lower() not in _BUTTONS:
        raise _Unmapped(f"unknown mouse button {value!r}")
    return _BUTTONS[value.lower()]


def _click_type(button: str, clicks: object) -> ActionType:
    if isinstance(clicks, bool) or not isinstance(clicks, int) or clicks < 1:
        raise _Unmapped(f"clicks must be a positive integer, got {clicks!r}")
    if clicks == 3:
        raise _Unmapped("triple click has no Dartboard action")
    if clicks > 3:
        raise _Unmapped(f"{clicks} clicks have no Dartboard action")
    if button == "middle":
        raise _Unmapped("middle click has no Dartboard action")
    if button == "right" and clicks == 2:
        raise _Unmapped("right double click has no Dartboard action")
    if button == "right":
        return ActionType.RIGHT_SINGLE
    return ActionType.CLICK if clicks == 1 else ActionType.LEFT_DOUBLE


def _key_name(value: object) -> str:
    """A key as Action.key spells it: a name lower-cased, whitespace characters named."""
    if not isinstance(value, str) or not value:
        raise _Unmapped(f"a key must be a non-empty string, got {value!r}")
    name = _KEY_CHARACTERS.get(value, value.lower())
    if "+" in name or any(ch.isspace() for ch in name):
        raise _Unmapped(f"key {value!r} cannot be written in Action.key ('+' and spaces join keys)")
    return name


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Writing ------------------------------------------------------------------------------------


def pyautogui_code(action: Action) -> str:
    """The plain pyautogui code of one action, in screenshot pixels (OSWorld's result folders
    record this); WAIT, DONE, FAIL for wait, finished, call_user. Keys are written in
    pyautogui's spelling ('control' as 'ctrl'), lower-cased; finished's text is not written.
    Text and keys enter only through `repr`."""
    t = action.type
    for word, word_type in _WORDS.items():
        if t == word_type:
            return word
    if t in (ActionType.CLICK, ActionType.LEFT_DOUBLE, ActionType.RIGHT_SINGLE):
        call = {ActionType.CLICK: "click", ActionType.LEFT_DOUBLE: "doubleClick"}.get(
            t, "rightClick"
        )
        return f"pyautogui.{call}({action.x}, {action.y})"
    if t == ActionType.DRAG:
        return (
            f"pyautogui.moveTo({action.x}, {action.y})\n"
            f"pyautogui.dragTo({action.x2}, {action.y2}, button='left')"
        )
    if t == ActionType.HOTKEY:
        names = pyautogui_keys(action.key or "", keys=frozenset())
        if not names:
            raise ValueError(f"hotkey {action.key!r} names no key")
        if len(names) == 1:
            return f"pyautogui.press({names[0]!r})"
        return f"pyautogui.hotkey({', '.join(repr(n) for n in names)})"
    if t == ActionType.TYPE:
        return f"pyautogui.write({action.text!r})"
    assert t == ActionType.SCROLL, t  # Action checks the type is one of the above
    call = "hscroll" if action.direction in ("left", "right") else "scroll"
    clicks = SCROLL_CLICKS if action.direction in ("up", "right") else -SCROLL_CLICKS
    return f"pyautogui.{call}({clicks}, x={action.x}, y={action.y})"


READ_CALLS: tuple[str, ...] = tuple(_SIGNATURES)
"""Every call a recorded step may hold (the docs' action reference lists them)."""
REFUSED_CALLS: dict[str, str] = dict(_NO_ACTION)
