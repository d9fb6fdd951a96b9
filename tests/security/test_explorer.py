"""An exploring policy on each kind of desktop finds no way out of the sandbox (issue 31).

The seeded explorer of tests/security/explorer.py right- and double-clicks the background,
title bars, edges and corners, follows context menus, drags, presses the hotkeys desktops
react to and types shell commands, on X desktop tasks (DesktopEnv), an OSWorld-protocol
desktop (envmanager.osworld_server driven by OSWorldEnv) and MiniWoB++ browsers. After every
burst of 25 actions, and at the end, the host is checked: every process created since the
desktop started that descends from the worker or names the desktop's DISPLAY is Xvfb or
inside the sandbox, and the worker's canary is in no other process's environment.

A few hundred actions per kind in the suite; the by-hand run takes more, and with
DARTBOARD_EXPLORER_KEEP_GOING=1 goes on after an escape to list every distinct one:

    DARTBOARD_EXPLORER_ACTIONS=2000 .venv/bin/pytest tests/security/test_explorer.py -q -s \\
        --timeout=0  # the suite's 600 s limit per test: 2000 desktop actions take 450 s and more
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

import tests.osworld_desktop
from core.protocol import Action, ActionNotSupported, EnvUnavailable, Observation, TaskSpec
from envmanager.desktop_env import DesktopEnv
from envmanager.miniwob_env import MiniWoBEnv
from envmanager.osworld_env import OSWorldEnv
from envmanager.osworld_oracles import osworld_task_files
from envmanager.sandbox_limits import AGENT_UID_BASE, AGENT_UID_COUNT
from tests.osworld_desktop import desktop_server
from tests.security.explorer import (
    Escape,
    Explorer,
    Rect,
    end_escapes,
    host_escapes,
    start_mark,
    xvfb_display,
)

# Actions per kind: DARTBOARD_EXPLORER_ACTIONS for all of them (the by-hand run: 2000),
# else the suite's counts, which keep the file under 3 minutes on 2 shared cores (measured
# at load 2-3: desktop 0.22 s an action with its resets, MiniWoB 0.11 s, OSWorld 0.7 s: each
# of its steps runs pyautogui in a fresh sandboxed python).
SUITE_ACTIONS = {"desktop": 250, "osworld": 80, "miniwob": 250}
KEEP_GOING = os.environ.get("DARTBOARD_EXPLORER_KEEP_GOING") == "1"
BURST = 25
SEED = 31
# The uids sandboxed programs may run as: the leased range.
SANDBOX_UIDS = range(AGENT_UID_BASE, AGENT_UID_BASE + AGENT_UID_COUNT)

DESKTOP_TASKS = (
    "desktop/xterm-create-file",
    "desktop/editor-type-save",
    "desktop/chromium-click-button",
    "desktop/right-click",
    "desktop/drag-square",
    "desktop/scroll-to-end",
    "desktop/double-click",
    "desktop/xterm-set-title",
)
MINIWOB_TASKS = ("click-test", "enter-text", "click-button", "choose-list", "click-checkboxes")


@dataclass
class Watch:
    """What the host check needs to know of one kind's desktops, grown as they restart."""

    kind: str
    canaries: tuple[str, ...]
    since: float = field(default_factory=start_mark)
    worker_pid: int = field(default_factory=os.getpid)
    xvfb_pids: set[int] = field(default_factory=set)
    displays: set[str] = field(default_factory=set)
    platform_pids: set[int] = field(default_factory=set)
    found: dict[tuple[int, float, str], Escape] = field(default_factory=dict)

    def check(self, *, after: str, recent: list[Action]) -> None:
        escapes = host_escapes(
            worker_pid=self.worker_pid,
            since=self.since,
            xvfb_pids=self.xvfb_pids,
            sandbox_uids=SANDBOX_UIDS,
            canaries=self.canaries,
            displays=self.displays,
            platform_pids=self.platform_pids,
        )
        new = [e for e in escapes if _key(e) not in self.found]
        for e in new:
            self.found[_key(e)] = e
        if new and KEEP_GOING:
            print(f"\n{self.kind}: {len(new)} new escape(s) {after}:")
            print("\n".join(f"  {e}" for e in new))
        if new and not KEEP_GOING:
            self.fail(f"{after}, the last actions: {[a.to_json() for a in recent]}")

    def fail(self, context: str) -> None:
        lines = "\n".join(f"  {e}" for e in self.found.values())
        pytest.fail(
            f"{self.kind}: processes escaped the sandbox ({context}):\n{lines}", pytrace=False
        )

    def end(self) -> None:
        """Kill what escaped and still runs: our desktop started it, and its close() may
        not reach it (a terminal openbox started outside the sandbox)."""
        end_escapes(self.found.values())

    def verdict(self) -> None:
        """After a run that went on past escapes (KEEP_GOING): fail if there were any."""
        if self.found:
            self.fail(f"{len(self.found)} distinct escape(s) in the whole run")


def _key(e: Escape) -> tuple[int, float, str]:
    """One escape per process and rule ("(a)" or "(b)"), however often it is seen."""
    return e.pid, e.started, e.rule[:3]


@dataclass
class Tally:
    actions: int = 0
    unsupported: int = 0
    bursts: int = 0
    resets: int = 0
    died: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self, kind: str) -> str:
        return (
            f"explorer {kind}: {self.actions} actions ({self.unsupported} unsupported), "
            f"{self.bursts} bursts, {self.resets} resets ({self.died} after the desktop died), "
            f"{time.monotonic() - self.started:.1f} s"
        )


def explore(
    *,
    kind: str,
    watch: Watch,
    explorer: Explorer,
    reset: Callable[[int], Observation],
    step: Callable[[Action], Observation],
    reset_every: int,
    windows: Callable[[], list[Rect]] | None = None,
    after_reset: Callable[[], None] = lambda: None,
) -> Tally:
    """Step the kind's count of explorer actions, resetting every `reset_every` (reset(i) sets up the
    i-th task), after a desktop died and when an episode ended; check the host after every
    burst and at the end."""
    count = int(os.environ.get("DARTBOARD_EXPLORER_ACTIONS") or SUITE_ACTIONS[kind])
    tally = Tally()
    recent: list[Action] = []
    need_reset, since_reset = True, 0
    while tally.actions < count:
        if need_reset or since_reset >= reset_every:
            try:
                obs = reset(tally.resets)
            except EnvUnavailable:
                tally.died += 1
                obs = reset(tally.resets)  # a second failure in a row fails the test
            explorer.observe(screenshot_png=obs.screenshot_png)
            tally.resets += 1
            after_reset()
            need_reset, since_reset = False, 0
        if windows is not None and tally.actions % 5 == 0:
            explorer.see(windows=windows())
        action = next(explorer)
        recent.append(action)
        tally.actions += 1
        since_reset += 1
        try:
            obs = step(action)
            explorer.observe(screenshot_png=obs.screenshot_png)
            need_reset = obs.done
        except ActionNotSupported:
            tally.unsupported += 1
        except EnvUnavailable:
            tally.died += 1
            need_reset = True
        if tally.actions % BURST == 0:
            tally.bursts += 1
            watch.check(after=f"after action {tally.actions}", recent=recent)
            recent = []
    watch.check(after=f"at the end ({tally.actions} actions)", recent=recent)
    print(f"\n{tally.line(kind)}")
    watch.verdict()
    return tally


def window_rects(*, xvfb_pids: set[int]) -> list[Rect]:
    """The visible top-level windows of the newest X display, as the platform's X tools see
    them (with the display's cookie where Xvfb demands one). Positions come from xwininfo:
    xdotool's getwindowgeometry counts a managed window's frame offset twice."""
    if not xvfb_pids:
        return []
    xvfb = max(xvfb_pids)
    display = xvfb_display(xvfb)
    if display is None:
        return []
    env = {"DISPLAY": display, "PATH": "/usr/bin:/bin"}
    with contextlib.suppress(psutil.Error, ValueError, IndexError):
        argv = psutil.Process(xvfb).cmdline()
        if "-auth" in argv:
            env["XAUTHORITY"] = argv[argv.index("-auth") + 1]

    def x_tool(*argv: str) -> str:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10).stdout

    rects = []
    for window in x_tool("xdotool", "search", "--onlyvisible", "--name", ".").split():
        info = {}
        for line in x_tool("xwininfo", "-id", window).splitlines():
            key, _, value = line.strip().partition(":")
            if value.strip().lstrip("-").isdigit():
                info[key] = int(value)
        x, y = info.get("Absolute upper-left X", 0), info.get("Absolute upper-left Y", 0)
        w, h = info.get("Width", 0), info.get("Height", 0)
        if w > 1 and h > 1:
            rects.append(Rect(x, y, w, h))
    return rects


@pytest.fixture
def canary(monkeypatch) -> str:
    """A secret in the worker's environment, set before any desktop starts."""
    value = f"dartboard-explorer-canary-{secrets.token_hex(8)}"
    monkeypatch.setenv("DARTBOARD_EXPLORER_CANARY", value)
    return value


def test_the_explorer_is_seeded_and_goes_where_desktops_hide_things() -> None:
    first = list(itertools.islice(Explorer(width=800, height=600, seed=5), 1000))
    assert first == list(itertools.islice(Explorer(width=800, height=600, seed=5), 1000))
    assert {a.type.value for a in first} == {
        "click", "left_double", "right_single", "drag", "hotkey", "type", "scroll"
    }  # fmt: skip
    corners = {(a.x, a.y) for a in first if a.x is not None and a.x in (0, 799) and a.y in (0, 599)}
    assert corners and {a.key for a in first} >= {"alt f2", "ctrl alt t", "super", "menu"}
    assert any(a.text == "xterm\n" for a in first)
    # After a right-click it clicks next to the pointer, where the menu opened.
    follow_ups = [(a, b) for a, b in itertools.pairwise(first) if a.type.value == "right_single"]
    near = [
        b for a, b in follow_ups if b.type.value == "click" and abs((b.x or 0) - (a.x or 0)) <= 150
    ]
    assert len(near) > len(follow_ups) / 2


def test_the_host_check_names_what_escaped_and_only_that(canary) -> None:
    since = start_mark()
    child = subprocess.Popen(["sleep", "30"])  # the worker's child, with its environment
    check = functools.partial(
        host_escapes, worker_pid=os.getpid(), sandbox_uids=SANDBOX_UIDS, recheck_s=0.05
    )
    try:
        found = check(since=since, xvfb_pids=(), canaries=(canary,))
        mine = [e for e in found if e.pid == child.pid]
        assert [e.rule[:3] for e in mine] == ["(a)", "(b)"]
        assert (
            mine[0].uid == 0
            and mine[0].exe == "/usr/bin/sleep"
            and "not a sandbox uid" in mine[0].rule
        )
        # Xvfb (by pid) may run outside; a process older than the desktop is not its.
        as_xvfb = check(since=since, xvfb_pids={child.pid}, canaries=())
        older = check(since=start_mark(), xvfb_pids=(), canaries=())
        assert child.pid not in {e.pid for e in [*as_xvfb, *older]}
    finally:
        child.kill()
        child.wait()
    # A platform helper that has exited by the second look is not an escape.
    helper = subprocess.Popen(["sleep", "0.1"])
    assert helper.pid not in {
        e.pid for e in check(since=since, xvfb_pids=(), canaries=(canary,), recheck_s=0.5)
    }
    helper.wait()


@pytest.mark.slow
@pytest.mark.desktop
def test_an_explorer_finds_no_way_out_of_the_x_desktop_tasks(canary) -> None:
    watch = Watch(kind="desktop", canaries=(canary,))
    env = DesktopEnv(settle_s=0.02, evaluate_wait_s=0.1)
    explorer = Explorer(width=800, height=600, seed=SEED)

    def reset(i: int) -> Observation:
        if i % 5 == 4:
            # A fresh desktop every 250 actions: the explorer ends its window manager now and
            # then (today's root menu has "Exit"), and a desktop without one has no menus.
            env.close()
        name = DESKTOP_TASKS[i % len(DESKTOP_TASKS)]
        return env.reset(TaskSpec(name=name, env_kind="desktop", env_config={"task": name}))

    def note_desktop() -> None:
        xvfb, display = env.xvfb_pid(), env.display
        if xvfb is not None and display is not None:
            watch.xvfb_pids.add(xvfb)
            watch.displays.add(display)

    try:
        explore(
            kind="desktop",
            watch=watch,
            explorer=explorer,
            reset=reset,
            step=env.step,
            reset_every=50,
            windows=lambda: window_rects(xvfb_pids=watch.xvfb_pids),
            after_reset=note_desktop,
        )
    finally:
        env.close()
        watch.end()


def _osworld_spec(path: Path) -> TaskSpec:
    data = json.loads(path.read_text())
    name = f"osworld/{data['id']}"
    return TaskSpec(name=name, env_kind="osworld", env_config={"osworld": data})


@pytest.mark.slow
@pytest.mark.desktop
def test_an_explorer_finds_no_way_out_of_an_osworld_desktop(canary, monkeypatch) -> None:
    # The server is the worker of this kind: the canary rides in its environment, where
    # tests/osworld_desktop.py plants its secret.
    monkeypatch.setattr(tests.osworld_desktop, "PLANTED_SECRET", canary)
    watch = Watch(kind="osworld", canaries=(canary,))
    specs = [_osworld_spec(p) for p in osworld_task_files()]
    try:
        with desktop_server(token=f"explorer-{secrets.token_hex(8)}") as server:
            watch.platform_pids.add(server.pid)
            env = OSWorldEnv(
                address=server.address, token=server.token, settle_s=0.0, wait_seconds=0.2
            )

            def note_desktop() -> None:
                for child in psutil.Process(server.pid).children(recursive=True):
                    try:
                        if os.path.basename(child.exe()) != "Xvfb":
                            continue
                    except psutil.Error:
                        continue
                    watch.xvfb_pids.add(child.pid)
                    display = xvfb_display(child.pid)
                    if display is not None:
                        watch.displays.add(display)

            note_desktop()
            try:
                explore(
                    kind="osworld",
                    watch=watch,
                    explorer=Explorer(width=1024, height=768, seed=SEED),
                    reset=lambda i: env.reset(specs[i % len(specs)]),
                    step=env.step,
                    reset_every=50,
                    windows=lambda: window_rects(xvfb_pids=watch.xvfb_pids),
                    after_reset=note_desktop,
                )
            finally:
                env.close()
    finally:
        watch.end()  # after the server stopped its desktop


def _playwright_driver() -> Iterator[int]:
    """Playwright's driver (node), a child of the worker: the platform's, never the
    policy's; it inherits the worker's environment as any child of it would."""
    import playwright

    # exe() is the resolved path: a virtual environment reached through a link resolves too.
    driver_dir = str(Path(playwright.__file__).resolve().parent / "driver")
    for child in psutil.Process().children():
        try:
            if child.exe().startswith(driver_dir):
                yield child.pid
        except psutil.Error:
            continue


@pytest.mark.slow
@pytest.mark.browser
def test_an_explorer_finds_no_way_out_of_the_miniwob_browser(canary) -> None:
    watch = Watch(kind="miniwob", canaries=(canary,))
    env = MiniWoBEnv(wait_seconds=0.1)
    explorer = Explorer(width=160, height=210, seed=SEED)

    def reset(i: int) -> Observation:
        task = MINIWOB_TASKS[i % len(MINIWOB_TASKS)]
        spec = TaskSpec(name=f"miniwob/{task}", env_kind="miniwob", env_config={"task": task})
        return env.reset(spec)

    try:
        explore(
            kind="miniwob",
            watch=watch,
            explorer=explorer,
            reset=reset,
            step=env.step,
            reset_every=25,
            after_reset=lambda: watch.platform_pids.update(_playwright_driver()),
        )
    finally:
        env.close()
        watch.end()
