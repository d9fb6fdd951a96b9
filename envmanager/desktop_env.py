"""Desktop backend: a real X desktop (Xvfb 800x600 + openbox) driven by xdotool.

Screen 800x600x24: big enough for xterm/chromium/Tk windows, small enough that a screenshot
is ~20 ms. Screenshots come from `scrot -o -` (PNG on stdout), measured 18 ms median against
30 ms for ImageMagick's `import -window root png:-` (xwd is not installed).

Model actions arrive only as structured `Action`s and become fixed xdotool argv lists (no
shell). Task setup comes only from `envmanager.desktop_tasks`. Each reset kills the previous
task's app process groups, recreates the task's directory and runs the setup steps. Every
app the policy drives, and the window manager it clicks on, runs in the desktop's bubblewrap
sandbox (`envmanager.sandbox`: a uid of its own, no network, a clean environment, a tmpfs
home, no view of the worker's files or secrets). Xvfb runs outside it (demanding a cookie),
and so do the platform's xdotool and scrot, with DISPLAY and XAUTHORITY as their only
environment.

    env = DesktopEnv(); obs = env.reset(TaskSpec(name="desktop/double-click", env_kind="desktop",
                                                 env_config={"task": "desktop/double-click"}))
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import subprocess
import tempfile
import time

import psutil

from core.protocol import (
    Action,
    ActionNotSupported,
    ActionType,
    EnvUnavailable,
    Evaluation,
    Observation,
    TaskSpec,
    desktop_text,
    hotkey_parts,
)
from envmanager.desktop_tasks import DARTAPP, DesktopState, Launch, WriteFile, desktop_task
from envmanager.sandbox import AGENT_PYTHON, TASK_DIR, Sandbox
from envmanager.sandbox_limits import SandboxLimits, SandboxUnavailable
from envmanager.xserver import SandboxedDisplay, XServer, XServerError

WIDTH, HEIGHT = 800, 600
SCROLL_CLICKS = 3  # wheel clicks per UI-TARS scroll
SCROLL_BUTTONS = {"up": "4", "down": "5", "left": "6", "right": "7"}
# After a keyboard-map change, how long the desktop's applications get to read the new map
# before a key on it is pressed (Tk reads it when the MappingNotify event reaches it).
KEYMAP_SETTLE_S = 0.1

# Canonical key names (lower case, as UI-TARS writes them) -> X keysyms for xdotool.
XDOTOOL_KEYS: dict[str, str] = {
    "ctrl": "ctrl",
    "control": "ctrl",
    "shift": "shift",
    "alt": "alt",
    "meta": "super",
    "cmd": "super",
    "command": "super",
    "win": "super",
    "super": "super",
    "enter": "Return",
    "return": "Return",
    "esc": "Escape",
    "escape": "Escape",
    "tab": "Tab",
    "backspace": "BackSpace",
    "delete": "Delete",
    "del": "Delete",
    "space": "space",
    "up": "Up",
    "down": "Down",
    "left": "Left",
    "right": "Right",
    "arrowup": "Up",
    "arrowdown": "Down",
    "arrowleft": "Left",
    "arrowright": "Right",
    "home": "Home",
    "end": "End",
    "pageup": "Prior",
    "pagedown": "Next",
    "insert": "Insert",
    "-": "minus",
    "=": "equal",
    "/": "slash",
    ".": "period",
    ",": "comma",
    ";": "semicolon",
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
}


def xdotool_hotkey(*, key: str) -> str:
    """'ctrl shift t' -> 'ctrl+shift+t'; ActionNotSupported for an unknown key name."""
    parts = hotkey_parts(key=key, names=XDOTOOL_KEYS, single=str.isalnum, known="letters, digits")
    return "+".join(parts)


def _parts_by_new_characters(text: str, *, limit: int) -> list[str]:
    """`text` cut into consecutive parts, each with at most `limit` distinct characters
    beyond ASCII."""
    parts: list[str] = []
    current = ""
    seen: set[str] = set()
    for ch in text:
        if not ch.isascii() and ch not in seen and len(seen) == limit:
            parts.append(current)
            current, seen = "", set()
        if not ch.isascii():
            seen.add(ch)
        current += ch
    return [*parts, current] if current else parts


class DesktopEnv(SandboxedDisplay):
    """One private X desktop; implements `Env`. Starts lazily at the first reset."""

    kind = "desktop"

    def __init__(
        self,
        *,
        timeout_s: float = 10.0,
        settle_s: float = 0.15,
        wait_seconds: float = 1.0,
        evaluate_wait_s: float = 1.5,
        limits: SandboxLimits = SandboxLimits(),
    ) -> None:
        """settle_s: pause after each action so apps draw before the screenshot.
        evaluate_wait_s: evaluate re-reads the state this long until the checker passes
        (apps write files asynchronously; polling never changes the state).
        """
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self.wait_seconds = wait_seconds
        self.evaluate_wait_s = evaluate_wait_s
        self.limits = limits
        self._x: XServer | None = None
        self._jail: Sandbox | None = None
        self._apps: list[subprocess.Popen] = []
        self._root = pathlib.Path(tempfile.mkdtemp(prefix="dartboard-desktop-"))
        self._sandbox = self._root / "task"  # the task directory, on the host side
        self._task_name: str | None = None
        self._typed_keycodes: list[int] = []  # mapped for the last text beyond ASCII
        self._instruction = ""
        self._step = 0

    # ---------------------------------------------------------------- lifecycle

    def _start(self) -> None:
        try:
            self._x = XServer.start(width=WIDTH, height=HEIGHT, timeout_s=self.timeout_s)
            self._jail = Sandbox(
                task_dir=self._sandbox,
                display=self._x.display,
                xauth_cookie=self._x.cookie,
                limits=self.limits,
            )
            self._x.start_wm(self._jail, timeout_s=self.timeout_s)
        except (XServerError, SandboxUnavailable, OSError, subprocess.SubprocessError) as exc:
            self.close()
            raise EnvUnavailable(f"desktop: cannot start Xvfb/openbox: {exc}") from exc

    def close(self) -> None:
        """Stop the task's apps, openbox and Xvfb, then free the sandbox; safe to call twice."""
        self._stop_display()
        self._task_name = None

    def recreate(self) -> None:
        """Drop the current desktop (dead or alive) and start a fresh one."""
        self.close()
        self._start()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
            shutil.rmtree(self._root, ignore_errors=True)

    @property
    def display(self) -> str | None:
        return self._x.display if self._x else None

    def xvfb_pid(self) -> int | None:
        return self._x.xvfb.pid if self._x else None

    def process_pids(self) -> list[int]:
        """Xvfb, openbox and app process trees (for memory accounting)."""
        roots = [self._x.xvfb, self._x.wm] if self._x else []
        pids = []
        for proc in [*roots, *self._apps]:
            if proc is None or proc.poll() is not None:
                continue
            pids.append(proc.pid)
            with contextlib.suppress(psutil.Error):
                pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        return pids

    def _require_alive(self, what: str) -> XServer:
        if self._x is None:
            raise EnvUnavailable(f"desktop: no X server (closed or died) during {what}")
        if not self._x.alive:
            display = self._x.display
            self.close()
            raise EnvUnavailable(f"desktop: Xvfb on {display} died (found during {what})")
        return self._x

    def _x_run(self, argv: list[str], *, what: str) -> bytes:
        """Run an X client against our display; failures become EnvUnavailable."""
        x = self._require_alive(what)
        try:
            done = subprocess.run(
                argv, env=x.environ(), capture_output=True, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            self.close()
            raise EnvUnavailable(
                f"desktop: {argv[0]} timed out after {self.timeout_s}s during {what}"
            ) from exc
        if done.returncode != 0:
            self._require_alive(what)  # a dead X server is the usual cause
            raise EnvUnavailable(
                f"desktop: {argv[0]} failed during {what}: {done.stderr.decode(errors='replace').strip()}"
            )
        return done.stdout

    # ---------------------------------------------------------------- Env protocol

    def reset(self, task: TaskSpec) -> Observation:
        """Close the previous task's apps, recreate the sandbox, run the task's setup."""
        definition = desktop_task(name=task.env_config.get("task") or task.name)
        if self._x is None or not self._x.alive:
            self.close()
            self._start()
        self._stop_apps()
        jail = self._require_jail()
        jail.prepare_task_dir()
        jail.write_file("dartapp.py", DARTAPP)
        for step in definition.setup:
            if isinstance(step, WriteFile):
                jail.write_file(step.path, step.content)
            elif isinstance(step, Launch):
                self._launch(step)
        self._task_name = definition.name
        self._instruction = task.instruction or definition.instruction
        self._step = 0
        return self._observe()

    def _require_jail(self) -> Sandbox:
        if self._jail is None:
            raise EnvUnavailable("desktop: no sandbox (the desktop is closed)")
        return self._jail

    def _launch(self, step: Launch) -> None:
        self._require_alive("reset")
        # Paths as the sandboxed app sees them.
        values = {"sandbox": TASK_DIR, "python": AGENT_PYTHON, "app": f"{TASK_DIR}/dartapp.py"}
        argv = [arg.format(**values) for arg in step.argv]
        try:
            self._apps.append(self._require_jail().popen(argv))
        except (SandboxUnavailable, OSError) as exc:
            raise EnvUnavailable(f"desktop: cannot start {argv[0]} in its sandbox: {exc}") from exc
        deadline = time.monotonic() + self.timeout_s * 2  # chromium's first start is slow
        while step.window not in " ".join(self.window_titles()):
            if time.monotonic() > deadline:
                raise EnvUnavailable(f"desktop: window {step.window!r} did not appear ({argv[0]})")
            time.sleep(0.05)
        time.sleep(0.2)  # let the app finish its first paint and take focus

    def step(self, action: Action) -> Observation:
        """Perform `action` with xdotool at screen pixels, then observe."""
        argv = self._xdotool_argv(action)
        if argv and action.type == ActionType.TYPE and not (action.text or "").isascii():
            self._type_any_script(action.text or "")
        elif argv:
            self._x_run(argv, what=f"step({action.type.value})")
        if action.type == ActionType.WAIT:
            time.sleep(self.wait_seconds)
        time.sleep(self.settle_s)
        self._step += 1
        return self._observe()

    def _type_any_script(self, text: str) -> None:
        """Type text with characters no key of the keyboard map holds. xdotool remaps a
        spare keycode for each such character just before pressing it, and an application
        that has not yet taken the remap in reads the old one: the first such character of
        a text was lost ('caf au lait' for 'café au lait', seen in the Tk editor). So every
        character is put on a spare keycode first (xmodmap), the clients get a moment to
        take the new map in, and xdotool finds each keysym already mapped. The keycodes stay
        mapped until the next such text: emptied right after typing, an application still
        working through the key events read them with the emptied map (under load the Tk
        editor kept only the first of eight CJK characters). A text with more such
        characters than spare keycodes goes in parts."""
        self._unmap_typed()
        spare = self._spare_keycodes()
        if not spare:
            raise EnvUnavailable("desktop: the keyboard map has no spare keycode to type with")
        for i, part in enumerate(_parts_by_new_characters(text, limit=len(spare))):
            if i:  # the previous part's keys must be read before its keycodes are reused
                time.sleep(5 * KEYMAP_SETTLE_S)
                self._unmap_typed()
            chars = sorted({ch for ch in part if not ch.isascii()})
            mapped = list(zip(spare, chars, strict=False))
            self._x_run(
                [
                    "xmodmap",
                    *[a for code, ch in mapped for a in ("-e", f"keycode {code} = U{ord(ch):04X}")],
                ],
                what="step(type): mapping characters",
            )
            self._typed_keycodes = [code for code, _ in mapped]
            time.sleep(KEYMAP_SETTLE_S)
            self._x_run(["xdotool", "type", "--delay", "5", "--", part], what="step(type)")

    def _unmap_typed(self) -> None:
        """Empty the keycodes the last text beyond ASCII was typed with."""
        codes, self._typed_keycodes = self._typed_keycodes, []
        if codes:
            self._x_run(
                ["xmodmap", *[a for code in codes for a in ("-e", f"keycode {code} =")]],
                what="step(type): unmapping characters",
            )

    def _spare_keycodes(self) -> list[int]:
        """Keycodes the keyboard map leaves empty (`xmodmap -pke`: `keycode  N =`)."""
        table = self._x_run(["xmodmap", "-pke"], what="step(type): reading the keyboard map")
        spare = []
        for line in table.decode(errors="replace").splitlines():
            head, _, syms = line.partition("=")
            if head.startswith("keycode") and not syms.strip():
                spare.append(int(head.split()[1]))
        return spare

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        """Run the task's checker on the sandbox and window titles (polls briefly)."""
        if self._task_name is None:
            return Evaluation(reward=0.0, success=False, details={"reason": "no task was reset"})
        checker = desktop_task(name=self._task_name).checker
        deadline = time.monotonic() + self.evaluate_wait_s
        while True:
            result = checker(
                DesktopState(sandbox=self._sandbox, window_titles=self.window_titles())
            )
            if result.success or time.monotonic() > deadline:
                return result
            time.sleep(0.1)

    # ---------------------------------------------------------------- internals

    def window_titles(self) -> list[str]:
        """Titles of the visible top-level windows."""
        out = self._x_run_lenient(
            ["xdotool", "search", "--onlyvisible", "--name", ".", "getwindowname", "%@"]
        )
        return [line for line in out.decode(errors="replace").splitlines() if line]

    def _x_run_lenient(self, argv: list[str]) -> bytes:
        """Like _x_run, but "no window matched" (rc 1, empty stderr) is an empty result."""
        x = self._require_alive(argv[0])
        try:
            done = subprocess.run(
                argv, env=x.environ(), capture_output=True, timeout=self.timeout_s
            )
        except subprocess.TimeoutExpired as exc:
            self.close()
            raise EnvUnavailable(f"desktop: {argv[0]} timed out after {self.timeout_s}s") from exc
        if done.returncode != 0:
            self._require_alive(argv[0])
        return done.stdout

    def _xdotool_argv(self, action: Action) -> list[str] | None:
        t = action.type
        for x, y in [(action.x, action.y), (action.x2, action.y2)]:
            if x is not None and y is not None and not (0 <= x < WIDTH and 0 <= y < HEIGHT):
                raise ActionNotSupported(
                    f"{t.value} at ({x}, {y}) is outside the {WIDTH}x{HEIGHT} desktop screen"
                )
        move = ["mousemove", str(action.x), str(action.y)]
        if t == ActionType.CLICK:
            return ["xdotool", *move, "click", "1"]
        if t == ActionType.LEFT_DOUBLE:
            return ["xdotool", *move, "click", "--repeat", "2", "--delay", "80", "1"]
        if t == ActionType.RIGHT_SINGLE:
            return ["xdotool", *move, "click", "3"]
        if t == ActionType.DRAG:
            mid_x = str((action.x + action.x2) // 2)  # type: ignore[operator]
            mid_y = str((action.y + action.y2) // 2)  # type: ignore[operator]
            return [
                "xdotool",
                *move,
                "mousedown",
                "1",
                "sleep",
                "0.05",
                "mousemove",
                mid_x,
                mid_y,
                "sleep",
                "0.05",
                "mousemove",
                str(action.x2),
                str(action.y2),
                "sleep",
                "0.05",
                "mouseup",
                "1",
            ]
        if t == ActionType.HOTKEY:
            return ["xdotool", "key", "--clearmodifiers", xdotool_hotkey(key=action.key or "")]
        if t == ActionType.TYPE:
            return ["xdotool", "type", "--delay", "5", "--", desktop_text(action)]
        if t == ActionType.SCROLL:
            button = SCROLL_BUTTONS[action.direction or "down"]
            return [
                "xdotool",
                *move,
                "click",
                "--repeat",
                str(SCROLL_CLICKS),
                "--delay",
                "30",
                button,
            ]
        if t in (ActionType.WAIT, ActionType.FINISHED, ActionType.CALL_USER):
            return None
        raise ActionNotSupported(f"desktop: no mapping for action {t.value!r}")  # pragma: no cover

    def _observe(self) -> Observation:
        png = self._x_run(["scrot", "--overwrite", "-"], what="screenshot")
        return Observation(
            screenshot_png=png,
            width=WIDTH,
            height=HEIGHT,
            instruction=self._instruction,
            metadata={
                "task": self._task_name,
                "step": self._step,
                "windows": self.window_titles(),
                "display": self.display,
            },
        )
