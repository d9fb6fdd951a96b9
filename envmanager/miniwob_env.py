"""MiniWoB++ backend: the `miniwob` package's task pages in one long-lived headless chromium.

Why Playwright over the package's own gym/selenium path (measured on this 2-core machine,
20 resets + 20 click steps of click-test, each with DOM read and a task-area screenshot):

    path                          reset median/p90    step median/p90    task switch
    Playwright (CDP)              31 / 85 ms          33 / 67 ms         62 ms
    selenium (the gym env path)   50 / 78 ms          50 / 67 ms         66 ms

Playwright's screenshot is clipped to the 160x210 task area by the browser (no full-window
PNG decode + crop in Python), and every call it makes fails fast with an error once the
browser process is gone, which is how a killed browser becomes `EnvUnavailable` instead of a
hang. We still use the package for everything task-related: its HTML task pages and
`core.js` API (`core.startEpisodeReal`, `core.getDOMInfo`, the `WOB_*` reward globals),
its field extractors and its `DOMElement` parser.

One browser and one page per env; switching task navigates the page to the other task's
HTML file (~60 ms), so one env serves every task without relaunching chromium.

Note: Playwright's sync API cannot run inside a thread that already runs an asyncio loop
(use it from Celery prefork workers or plain processes, as bench/envs.py does).

    env = MiniWoBEnv()
    obs = env.reset(TaskSpec(name="miniwob/click-test", env_kind="miniwob",
                             env_config={"task": "click-test"}, seed=0))
    obs = env.step(Action(type=ActionType.CLICK, x=50, y=130)); print(env.evaluate())
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from core.protocol import (
    Action,
    ActionNotSupported,
    ActionType,
    EnvUnavailable,
    Evaluation,
    Observation,
    TaskSpec,
    hotkey_parts,
    typed_text,
)
from envmanager.sandbox_limits import ALLOW_UNLIMITED_ENV
from envmanager.sandboxed_browser import browser_launcher

SCREEN_WIDTH = 160  # miniwob.constants.TASK_WIDTH: the task area, top-left of the page
SCREEN_HEIGHT = 210  # miniwob.constants.TASK_HEIGHT
# The package's own window size: a viewport as small as the task area would add scrollbars
# (the reward display sits right of the task), so we keep its layout and clip screenshots.
VIEWPORT = {"width": 500, "height": 320}
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
]
SCROLL_PIXELS = 100  # one UI-TARS scroll = 100 CSS px of wheel delta

# Canonical key names (lower case, as UI-TARS writes them) -> Playwright key names.
PLAYWRIGHT_KEYS: dict[str, str] = {
    "ctrl": "Control",
    "control": "Control",
    "shift": "Shift",
    "alt": "Alt",
    "meta": "Meta",
    "cmd": "Meta",
    "command": "Meta",
    "win": "Meta",
    "super": "Meta",
    "enter": "Enter",
    "return": "Enter",
    "esc": "Escape",
    "escape": "Escape",
    "tab": "Tab",
    "backspace": "Backspace",
    "delete": "Delete",
    "del": "Delete",
    "space": "Space",
    "up": "ArrowUp",
    "down": "ArrowDown",
    "left": "ArrowLeft",
    "right": "ArrowRight",
    "arrowup": "ArrowUp",
    "arrowdown": "ArrowDown",
    "arrowleft": "ArrowLeft",
    "arrowright": "ArrowRight",
    "home": "Home",
    "end": "End",
    "pageup": "PageUp",
    "pagedown": "PageDown",
    "insert": "Insert",
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
}

_OBSERVE_JS = """() => ({
  utterance: core.getUtterance(),
  dom: core.getDOMInfo(),
  done: WOB_DONE_GLOBAL,
  raw_reward: WOB_RAW_REWARD_GLOBAL,
  env_reward: WOB_REWARD_GLOBAL,
  reason: WOB_REWARD_REASON == null ? null : String(WOB_REWARD_REASON),
})"""
_STATUS_JS = """() => ({
  done: WOB_DONE_GLOBAL,
  raw_reward: WOB_RAW_REWARD_GLOBAL,
  env_reward: WOB_REWARD_GLOBAL,
  reason: WOB_REWARD_REASON == null ? null : String(WOB_REWARD_REASON),
})"""


class _PlaywrightDriver(threading.local):
    """Playwright's driver process, shared by the MiniWoBEnvs of one thread.

    The sync API allows a single running Playwright per thread (a second `start()` fails
    with "using Playwright Sync API inside the asyncio loop"), so envs share it and each
    launches its own browser. It stops when the last env of the thread closes.
    """

    playwright: Any = None
    users: int = 0

    def acquire(self) -> Any:
        if self.playwright is None:
            # Imported on first use: playwright's driver is started only where MiniWoB runs.
            from playwright._impl import transport
            from playwright.sync_api import sync_playwright

            # The driver (node, outside the sandbox) would get a copy of the worker's whole
            # environment, secrets included; it gets what it and the browser launcher read.
            transport.get_driver_env = _driver_env  # type: ignore[attr-defined]
            self.playwright = sync_playwright().start()
        self.users += 1
        return self.playwright

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0 and self.playwright is not None:
            with contextlib.suppress(Exception):
                self.playwright.stop()
            self.playwright, self.users = None, 0


def _driver_env() -> dict[str, str]:
    """Playwright's driver environment, allow-listed: its own PW_ variables (from the
    library's `get_driver_env`), the basics of a process, and the sandbox's one switch the
    browser launcher (`envmanager.sandboxed_browser`) reads. No SECRET_KEY, database URL,
    token or bucket key."""
    from playwright._impl._driver import get_driver_env

    keep = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ", ALLOW_UNLIMITED_ENV}
    return {
        k: v
        for k, v in get_driver_env().items()
        if k in keep or k.startswith(("PW_", "PLAYWRIGHT_"))
    }


_DRIVER = _PlaywrightDriver()


def miniwob_html_dir() -> pathlib.Path:
    """The directory of the package's task pages (`<task>.html`)."""
    import miniwob

    return pathlib.Path(miniwob.__file__).parent / "html" / "miniwob"


def playwright_hotkey(*, key: str) -> str:
    """'ctrl shift a' -> 'Control+Shift+a' (Playwright's chord syntax).

    Raises ActionNotSupported for a key name neither in PLAYWRIGHT_KEYS nor one character.
    """
    parts = hotkey_parts(
        key=key, names=PLAYWRIGHT_KEYS, single=str.isprintable, known="single characters"
    )
    return "+".join(parts)


def flatten_dom(*, raw_dom: dict[str, Any]) -> list[dict[str, Any]]:
    """The package's DOM tree as a flat, JSON-able list of elements in document order.

    Each element: ref, parent_ref, tag, left, top, width, height (screen pixels), text (leaf
    text or None), value, id, classes, focused, bg_color, fg_color (RGBA floats in [0, 1]).
    """
    from miniwob.dom import DOMElement

    out: list[dict[str, Any]] = []

    def visit(element: DOMElement, parent_ref: int | None) -> None:
        out.append(
            {
                "ref": element.ref,
                "parent_ref": parent_ref,
                "tag": element.tag,
                "left": element.left,
                "top": element.top,
                "width": element.width,
                "height": element.height,
                "text": element.text,
                "value": element.value,
                "id": element.id,
                "classes": element.classes,
                "focused": element.focused,
                "bg_color": list(element.bg_color),
                "fg_color": list(element.fg_color),
            }
        )
        for child in element.children:
            visit(child, element.ref)

    visit(DOMElement(raw_dom), None)
    return out


class MiniWoBEnv:
    """One headless chromium showing MiniWoB++ task pages; implements `Env`.

    The browser starts lazily at the first `reset` and is reused across tasks. Any browser
    failure raises `EnvUnavailable` and tears the dead browser down; the next `reset` (or
    `recreate()`) launches a fresh one.
    """

    kind = "miniwob"

    def __init__(
        self,
        *,
        chromium: str | None = None,
        timeout_s: float = 10.0,
        launch_timeout_s: float = 60.0,
        wait_seconds: float = 0.5,
        episode_seconds: float | None = None,
    ) -> None:
        """chromium: browser binary (default $MINIWOB_CHROME_BINARY or /usr/bin/chromium).
        timeout_s: limit for navigations, screenshots and input calls.
        launch_timeout_s: limit for starting the browser; chromium in its sandbox on a
        machine busy with other browsers and a trainer can take well over 10 s to start.
        wait_seconds: how long a `wait` action sleeps.
        episode_seconds: override the task's own time limit (MiniWoB default 10 s; a slow
        CPU policy may need more). None keeps the task's limit. env_config
        {"episode_seconds": N} overrides it per task.
        """
        self.chromium = chromium or os.environ.get("MINIWOB_CHROME_BINARY", "/usr/bin/chromium")
        self.timeout_s = timeout_s
        self.launch_timeout_s = launch_timeout_s
        self.wait_seconds = wait_seconds
        self.episode_seconds = episode_seconds
        self._playwright: Any = None
        self._browser: Any = None
        self._page: Any = None
        self._task: str | None = None
        self._fields: dict[str, str] = {}
        self._instruction = ""
        self._marker = uuid.uuid4().hex
        # Playwright starts the browser through this launcher: chromium in the sandbox.
        self._launcher_dir = Path(tempfile.mkdtemp(prefix="dartboard-miniwob-"))
        self._executable = str(
            browser_launcher(
                self._launcher_dir, chromium=self.chromium, pages=miniwob_html_dir().parent
            )
        )

    # ---------------------------------------------------------------- lifecycle

    def _launch(self) -> None:
        self._playwright = _DRIVER.acquire()
        try:
            self._browser = self._playwright.chromium.launch(
                executable_path=self._executable,
                # An unknown switch chromium ignores, so browser_pid() can tell ours apart.
                args=[*CHROMIUM_ARGS, f"--dartboard-env={self._marker}"],
                timeout=self.launch_timeout_s * 1000,
            )
            self._page = self._browser.new_page(viewport=VIEWPORT)
            self._page.set_default_timeout(self.timeout_s * 1000)
        except Exception as exc:
            self.close()
            raise EnvUnavailable(f"miniwob: cannot launch {self.chromium}: {exc}") from exc
        self._task = None

    def close(self) -> None:
        """Stop the browser and Playwright's driver; safe to call twice or on a dead browser."""
        if self._browser is not None:
            with contextlib.suppress(Exception):
                self._browser.close()
        if self._playwright is not None:
            _DRIVER.release()
        self._playwright = self._browser = self._page = None
        self._task = None

    def recreate(self) -> None:
        """Drop the current browser (dead or alive) and launch a fresh one."""
        self.close()
        self._launch()

    @property
    def alive(self) -> bool:
        return self._page is not None

    def browser_pid(self) -> int | None:
        """PID of this env's chromium main process (found by its marker switch), or None.
        The sandbox's bubblewrap processes carry the marker in their command lines too: the
        browser is the one whose program is chromium itself."""
        for child in psutil.Process().children(recursive=True):
            try:
                cmdline = child.cmdline()
            except psutil.Error:
                continue
            if (
                f"--dartboard-env={self._marker}" in cmdline
                and Path(cmdline[0]).name == "chromium"
                and not any(arg.startswith("--type=") for arg in cmdline)
            ):
                return child.pid
        return None

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Turn any browser/driver failure into EnvUnavailable and drop the dead browser."""
        if self._page is None:
            raise EnvUnavailable(f"miniwob: no browser (closed or died) during {what}")
        try:
            yield
        except (ActionNotSupported, EnvUnavailable):
            raise
        except Exception as exc:
            self.close()
            raise EnvUnavailable(f"miniwob: browser failed during {what}: {exc}") from exc

    # ---------------------------------------------------------------- Env protocol

    def reset(self, task: TaskSpec) -> Observation:
        """Start a new episode of env_config["task"] (e.g. "click-test") with task.seed."""
        subdomain = task.env_config.get("task")
        if not subdomain:
            raise ValueError(f"miniwob task {task.name!r} needs env_config['task']")
        page_file = miniwob_html_dir() / f"{subdomain}.html"
        if not page_file.exists():
            raise ValueError(f"unknown miniwob task {subdomain!r}: no {page_file}")
        if self._page is None:
            self._launch()
        seconds = task.env_config.get("episode_seconds", self.episode_seconds)
        with self._guard(f"reset({subdomain})"):
            if self._task != subdomain:
                self._page.goto(page_file.as_uri())
                self._page.wait_for_selector("#sync-task-cover")
                self._task = subdomain
            self._page.evaluate("() => core.endEpisode(0)")  # stop a running episode
            if task.seed is not None:
                self._page.evaluate("(s) => Math.seedrandom(s)", task.seed)
            self._page.evaluate("() => core.setDataMode('train')")
            if seconds is not None:
                self._page.evaluate("(ms) => { core.EPISODE_MAX_TIME = ms; }", seconds * 1000)
            self._page.evaluate("() => core.startEpisodeReal()")
            self._wait_task_ready()
            self._fields = self._extract_fields(subdomain)
            return self._observe()

    def _wait_task_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._page.evaluate("() => WOB_TASK_READY"):
            if time.monotonic() > deadline:
                raise EnvUnavailable(
                    f"miniwob: task {self._task} not ready after {self.timeout_s}s"
                )
            time.sleep(0.05)

    def _extract_fields(self, subdomain: str) -> dict[str, str]:
        from miniwob.fields import get_field_extractor

        utterance = self._page.evaluate("() => core.getUtterance()")
        self._instruction = utterance
        try:
            extractor = get_field_extractor(subdomain)
        except KeyError:
            return {}
        return {str(k): str(v) for k, v in extractor(utterance)}

    def step(self, action: Action) -> Observation:
        """Perform `action` at screen pixels; actions after the task ended are ignored."""
        self._check_action(action)
        with self._guard(f"step({action.type.value})"):
            if not self._page.evaluate("() => WOB_DONE_GLOBAL"):
                self._perform(action)
            return self._observe()

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        """The task's own reward: max(0, raw) so failure/timeout/unfinished are 0."""
        with self._guard("evaluate"):
            status = self._page.evaluate(_STATUS_JS)
        raw = float(status["raw_reward"])
        details = {"task": self._task, **status}
        if not status["done"]:
            details["reason"] = "episode not finished"
            return Evaluation(reward=0.0, success=False, details=details)
        return Evaluation(reward=min(1.0, max(0.0, raw)), success=raw > 0, details=details)

    # ---------------------------------------------------------------- internals

    def _check_action(self, action: Action) -> None:
        points = []
        if action.x is not None and action.y is not None:
            points.append((action.x, action.y))
        if action.type == ActionType.DRAG:
            assert action.x2 is not None and action.y2 is not None  # Action.__post_init__
            points.append((action.x2, action.y2))
        for x, y in points:
            if not (0 <= x < SCREEN_WIDTH and 0 <= y < SCREEN_HEIGHT):
                raise ActionNotSupported(
                    f"{action.type.value} at ({x}, {y}) is outside the "
                    f"{SCREEN_WIDTH}x{SCREEN_HEIGHT} MiniWoB screen"
                )
        if action.type == ActionType.HOTKEY:
            playwright_hotkey(key=action.key or "")
        if action.type == ActionType.TYPE:
            typed_text(action)

    def _perform(self, action: Action) -> None:
        mouse, keyboard = self._page.mouse, self._page.keyboard
        t = action.type
        if t == ActionType.CLICK:
            mouse.click(action.x, action.y)
        elif t == ActionType.LEFT_DOUBLE:
            mouse.dblclick(action.x, action.y)
        elif t == ActionType.RIGHT_SINGLE:
            mouse.click(action.x, action.y, button="right")
        elif t == ActionType.DRAG:
            mouse.move(action.x, action.y)
            mouse.down()
            mouse.move(action.x2, action.y2, steps=5)
            mouse.up()
        elif t == ActionType.HOTKEY:
            keyboard.press(playwright_hotkey(key=action.key or ""))
        elif t == ActionType.TYPE:
            lines = (action.text or "").split("\n")
            for i, line in enumerate(lines):
                if line:
                    keyboard.type(line)
                if i < len(lines) - 1:
                    keyboard.press("Enter")
        elif t == ActionType.SCROLL:
            dx, dy = {
                "up": (0, -SCROLL_PIXELS),
                "down": (0, SCROLL_PIXELS),
                "left": (-SCROLL_PIXELS, 0),
                "right": (SCROLL_PIXELS, 0),
            }[action.direction or "down"]
            mouse.move(action.x, action.y)
            mouse.wheel(dx, dy)
        elif t == ActionType.WAIT:
            time.sleep(self.wait_seconds)
        elif t in (ActionType.FINISHED, ActionType.CALL_USER):
            pass  # the episode runner ends the episode; the page has nothing to do
        else:  # pragma: no cover - ActionType is closed
            raise ActionNotSupported(f"miniwob: no mapping for action {t.value!r}")

    def _observe(self) -> Observation:
        state = self._page.evaluate(_OBSERVE_JS)
        png = self._page.screenshot(
            clip={"x": 0, "y": 0, "width": SCREEN_WIDTH, "height": SCREEN_HEIGHT},
            type="png",
        )
        metadata = {
            "task": self._task,
            "utterance": state["utterance"],
            "fields": dict(self._fields),
            "dom_elements": flatten_dom(raw_dom=state["dom"]),
            "done": bool(state["done"]),
            "raw_reward": float(state["raw_reward"]),
            "reason": state["reason"],
        }
        # The utterance disappears from the page once the task ends; keep the reset one.
        return Observation(
            screenshot_png=png,
            width=SCREEN_WIDTH,
            height=SCREEN_HEIGHT,
            instruction=self._instruction,
            metadata=metadata,
            done=metadata["done"],
        )


def png_size(*, png: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, for checks."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return image.size
