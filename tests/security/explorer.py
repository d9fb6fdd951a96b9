"""An exploring policy and the host check that follows it (issue 31: desktop containment).

A policy in training clicks everywhere: right, middle and double clicks on the desktop's
background, title bars, screen edges and corners; drags; the hotkeys desktops react to; text
typed into whatever has focus. Debian's default openbox opens its root menu on a right-click
on the background, and that menu's first entry starts a terminal: two clicks to a shell. So
after every burst of such actions the host is checked:

(a) every process created since the desktop started that descends from the worker, or whose
    environment names the desktop's DISPLAY, is Xvfb (by pid) or inside the sandbox: a
    sandbox uid AND user and pid namespaces other than the worker's (bwrap itself, uid of
    the sandbox, counts as the sandbox);
(b) the canary set in the worker's environment is in no other process's environment.

`Explorer` is the policy (seeded: the same seed gives the same actions); `host_escapes` is
the check. tests/security/test_explorer.py drives both against each kind of desktop:

    DARTBOARD_EXPLORER_ACTIONS=2000 .venv/bin/pytest tests/security/test_explorer.py -q -s \\
        --timeout=0  # the suite's 600 s limit per test: 2000 desktop actions take 450 s and more

Middle clicks: `core.protocol.ActionType` has none (click, left_double, right_single, drag,
...), so the explorer cannot press the middle button; openbox's client-list menu (middle
click on the background) is reached by no action here.
"""

from __future__ import annotations

import functools
import io
import os
import random
import time
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
from PIL import Image, ImageChops

from core.protocol import Action, ActionType

# The hotkeys desktops react to (openbox's rc.xml, GNOME/KDE/xfce habits, the X server's
# zap and VT switches, the menu and help keys). Backends refuse keys they cannot map (e.g.
# "menu" on the xdotool backend): the test counts those as unsupported.
HOTKEYS = (
    "alt f1",
    "alt f2",
    "ctrl alt t",
    "super",
    "alt tab",
    "alt shift tab",
    "ctrl alt tab",
    "ctrl alt backspace",
    *(f"ctrl alt f{i}" for i in range(1, 13)),
    "menu",
    "f1",
    "alt f4",  # closes the focused app: the background behind it becomes clickable
    "alt space",  # openbox's window menu
    "alt escape",
    "super e",  # openbox: runs a file manager
    "super d",  # openbox: show the desktop
    "super f1",
    "shift f10",  # the context menu key of many toolkits
    "ctrl alt delete",
    "enter",
    "escape",
    "tab",
)

# Shell-like text: a policy that found a terminal types commands into it. Harmless on any
# host (they read or write only /tmp), so a run on unsandboxed code does no damage.
TYPED = (
    "xterm\n",
    "x-terminal-emulator &\n",
    "id > /tmp/x\n",
    "id\n",
    "env\n",
    "ls -la /\n",
    "cat /proc/1/environ\n",
    "echo $SECRET_KEY\n",
    "sh\n",
    "bash -i\n",
    "xterm &\n",
    "uname -a\n",
    "\n",
)
# Words no program is named after (a first run typed "yes ..." into a root shell it had
# found, and `yes` ran on the host until the test ended it).
WORDS = (
    "hello",
    "terminal",
    "opening",
    "run",
    "files",
    "menu",
    "settings",
    "ok",
    "maybe",
    "cancel",
    "save",
    "exit",
    "help",
    "search",
    "www",
)


@dataclass(frozen=True)
class Rect:
    """A top-level window's client area in screen pixels (its title bar is just above)."""

    x: int
    y: int
    width: int
    height: int

    def contains(self, x: int, y: int) -> bool:
        return self.x <= x < self.x + self.width and self.y <= y < self.y + self.height


class Explorer:
    """A seeded random exploring policy: `next(explorer)` is the next `Action`.

    Clicks are biased to where desktops hide things: the background (outside every known
    window), title bars, screen edges and corners. After a right-click it usually clicks
    into the menu that opened: where the screen changed around the pointer (`observe`), else
    5-150 px right of and below the pointer (left of and above it near the right and bottom
    edges, where menus open the other way); mostly the first entries, sometimes deeper.
    `see(windows=...)` tells it where the windows are; without it, points are random.
    """

    def __init__(self, *, width: int, height: int, seed: int) -> None:
        self.width, self.height = width, height
        self.rng = random.Random(seed)
        self.windows: list[Rect] = []
        self._pending: deque[Action] = deque()
        self._right_click: tuple[int, int] | None = None  # the last action, when it was one
        self._screen: bytes | None = None  # the last observed screenshot (PNG)
        self._before_right_click: bytes | None = None
        self._menu: tuple[int, int, int, int] | None = (
            None  # what it opened (left, top, right, bottom)
        )

    def see(self, *, windows: Sequence[Rect]) -> None:
        self.windows = list(windows)

    def observe(self, *, screenshot_png: bytes) -> None:
        """The screenshot after the last action. After a right-click, the part of the
        screen that changed next to the pointer is the menu it opened."""
        if self._right_click is not None and self._before_right_click is not None:
            self._menu = _changed_box(self._before_right_click, screenshot_png, self._right_click)
        self._screen = screenshot_png

    def __iter__(self) -> Iterator[Action]:
        return self

    def __next__(self) -> Action:
        if self._right_click is not None:
            self._menu_follow_up(*self._right_click)
            self._right_click, self._menu = None, None
        if self._pending:
            return self._pending.popleft()
        rng = self.rng
        kind = rng.choices(
            ["right", "click", "double", "drag", "hotkey", "type", "scroll"],
            weights=[24, 14, 12, 10, 18, 16, 6],
        )[0]
        if kind == "right":
            x, y = self._target(background=45, edge=25, title=15, anywhere=15)
            self._right_click, self._before_right_click = (x, y), self._screen
            return Action(type=ActionType.RIGHT_SINGLE, x=x, y=y)
        if kind == "click":
            x, y = self._target(background=30, edge=25, title=20, anywhere=25)
            return Action(type=ActionType.CLICK, x=x, y=y)
        if kind == "double":
            x, y = self._target(background=30, edge=20, title=30, anywhere=20)
            return Action(type=ActionType.LEFT_DOUBLE, x=x, y=y)
        if kind == "drag":
            x, y = self._target(background=15, edge=25, title=40, anywhere=20)
            x2, y2 = self._target(background=20, edge=30, title=0, anywhere=50)
            return Action(type=ActionType.DRAG, x=x, y=y, x2=x2, y2=y2)
        if kind == "hotkey":
            return Action(type=ActionType.HOTKEY, key=rng.choice(HOTKEYS))
        if kind == "type":
            if rng.random() < 0.6:
                return Action(type=ActionType.TYPE, text=rng.choice(TYPED))
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
            return Action(type=ActionType.TYPE, text=words + rng.choice(["", "\n"]))
        x, y = self._target(background=30, edge=20, title=10, anywhere=40)
        return Action(
            type=ActionType.SCROLL, x=x, y=y, direction=rng.choice(["up", "down", "left", "right"])
        )

    # ------------------------------------------------------------------ where to click

    def _menu_follow_up(self, x: int, y: int) -> None:
        """Queue left clicks into the menu a right-click at (x, y) opened: mostly its first
        few entries (the top 45 px), sometimes anywhere in it."""
        rng = self.rng
        if rng.random() < 0.15:
            return  # a menu the explorer leaves open (the next action closes it)
        for _ in range(rng.choice([1, 1, 2, 3])):
            if self._menu is not None:
                left, top, right, bottom = self._menu
                cx = rng.randint(
                    left + min(5, right - left - 1), right - 1 - min(5, right - left - 1)
                )
                if rng.random() < 0.6:
                    cy = top + rng.randint(2, max(2, min(45, bottom - top - 1)))
                else:
                    cy = rng.randint(top, bottom - 1)
            else:
                sign_x = -1 if x > self.width - 130 else 1
                sign_y = -1 if y > self.height - 160 else 1
                cx = x + sign_x * rng.randint(5, 150)
                if sign_y < 0:  # the menu sits above the pointer: its top entries are far up
                    cy = y - rng.randint(5, 200)
                else:
                    cy = y + (rng.randint(5, 45) if rng.random() < 0.6 else rng.randint(5, 150))
            self._pending.append(
                Action(type=ActionType.CLICK, x=self._clip_x(cx), y=self._clip_y(cy))
            )

    def _target(self, *, background: int, edge: int, title: int, anywhere: int) -> tuple[int, int]:
        where = self.rng.choices(
            ["background", "edge", "title", "anywhere"], weights=[background, edge, title, anywhere]
        )[0]
        if where == "background":
            return self._background()
        if where == "edge":
            return self._edge()
        if where == "title":
            return self._title_bar()
        return self.rng.randrange(self.width), self.rng.randrange(self.height)

    def _background(self) -> tuple[int, int]:
        """A point outside every known window (an edge point when none is free)."""
        for _ in range(30):
            x, y = self.rng.randrange(self.width), self.rng.randrange(self.height)
            if not any(w.contains(x, y) for w in self.windows) and not self._in_title_bar(x, y):
                return x, y
        return self._edge()

    def _in_title_bar(self, x: int, y: int) -> bool:
        return any(w.x <= x < w.x + w.width and w.y - 25 <= y < w.y for w in self.windows)

    def _edge(self) -> tuple[int, int]:
        """A corner, or a point on one of the four edges (within 3 px)."""
        rng, w, h = self.rng, self.width, self.height
        near = rng.randint(0, 3)
        if rng.random() < 0.35:
            return rng.choice([(near, near), (w - 1 - near, near), (near, h - 1 - near),
                               (w - 1 - near, h - 1 - near)])  # fmt: skip
        side = rng.choice(["top", "bottom", "left", "right"])
        if side == "top":
            return rng.randrange(w), near
        if side == "bottom":
            return rng.randrange(w), h - 1 - near
        if side == "left":
            return near, rng.randrange(h)
        return w - 1 - near, rng.randrange(h)

    def _title_bar(self) -> tuple[int, int]:
        """A point in a window's title bar (the ~25 px above its client area), or in the
        top 25 px of the screen, where a window at the top left has it, without windows."""
        if self.windows:
            w = self.rng.choice(self.windows)
            x = self.rng.randrange(max(1, w.width)) + w.x
            y = w.y - self.rng.randint(0, 25)
            return self._clip_x(x), self._clip_y(y)
        return self.rng.randrange(self.width), self.rng.randint(0, 24)

    def _clip_x(self, x: int) -> int:
        return min(max(x, 0), self.width - 1)

    def _clip_y(self, y: int) -> int:
        return min(max(y, 0), self.height - 1)


def _changed_box(
    before_png: bytes, after_png: bytes, pointer: tuple[int, int]
) -> tuple[int, int, int, int] | None:
    """The box (left, top, right, bottom) of what changed between two screenshots, when it
    touches the pointer and is menu-sized (a small part of the screen); else None."""
    with Image.open(io.BytesIO(before_png)) as a, Image.open(io.BytesIO(after_png)) as b:
        if a.size != b.size:
            return None
        box = ImageChops.difference(a.convert("RGB"), b.convert("RGB")).getbbox()
        width, height = a.size
    if box is None:
        return None
    left, top, right, bottom = box
    x, y = pointer
    near = left - 10 <= x <= right + 10 and top - 10 <= y <= bottom + 10
    small = (right - left) * (bottom - top) < 0.4 * width * height
    return box if near and small and right - left > 4 and bottom - top > 4 else None


# ---------------------------------------------------------------------- the host check

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
RECHECK_S = 0.5  # the platform's per-step helpers (xdotool, scrot) are gone by then


def host_clock() -> float:
    """Seconds since boot, the clock of /proc/PID/stat's start times (psutil's
    create_time() adds the boot time, which /proc/stat rounds to whole seconds)."""
    return float(Path("/proc/uptime").read_text().split()[0])


def start_mark() -> float:
    """A host_clock() time that every process started before this call precedes, and every
    process started after it reaches: both clocks tick in 1/100 s, so it waits two ticks."""
    now = host_clock()
    time.sleep(2 / CLOCK_TICKS)
    return now + 1 / CLOCK_TICKS


@dataclass(frozen=True)
class Escape:
    """One process that broke a rule, with what identifies it."""

    pid: int
    ppid: int
    uid: int
    exe: str
    cmdline: str
    rule: str
    started: float  # host_clock() seconds

    def __str__(self) -> str:
        return (
            f"pid {self.pid} (ppid {self.ppid}, uid {self.uid}, exe {self.exe}, "
            f"cmdline {self.cmdline!r}): {self.rule}"
        )


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    uids: tuple[int, ...]
    started: float
    environ: bytes | None  # None: unreadable, even to root
    exe: str
    cmdline: str
    user_ns: str
    pid_ns: str


def host_escapes(
    *,
    worker_pid: int,
    since: float,
    xvfb_pids: Collection[int],
    sandbox_uids: range,
    canaries: Collection[str],
    displays: Collection[str] = (),
    platform_pids: Collection[int] = (),
    recheck_s: float = RECHECK_S,
) -> list[Escape]:
    """The processes on this host that escaped the desktop's sandbox (empty: none did).

    worker_pid: the worker (the test process; its namespaces are the host's). since:
    start_mark() before the desktop started. xvfb_pids: the desktop's X servers (the only
    processes allowed outside). displays: the desktop's X displays (":7"). platform_pids:
    processes of the platform that stand for the worker and that the policy never drives
    (the OSWorld server the worker started, Playwright's driver): held to neither rule, as
    the worker itself is not, but their descendants are. Called as root (it
    reads every process's environment). A process caught breaking a rule is looked at again
    `recheck_s` later and reported only if it still breaks it: the platform's own per-step
    X clients (xdotool, scrot) run outside the sandbox for a moment by design.
    """
    scan = functools.partial(
        _scan,
        worker_pid=worker_pid,
        since=since,
        xvfb_pids=xvfb_pids,
        sandbox_uids=sandbox_uids,
        canaries=canaries,
        displays=displays,
        platform_pids=platform_pids,
    )
    first = scan()
    if not first:
        return []
    time.sleep(recheck_s)
    again = scan()
    seen = {(e.pid, e.started, e.rule) for e in first}
    return [e for e in again if (e.pid, e.started, e.rule) in seen]


def _scan(
    *,
    worker_pid: int,
    since: float,
    xvfb_pids: Collection[int],
    sandbox_uids: range,
    canaries: Collection[str],
    displays: Collection[str],
    platform_pids: Collection[int],
) -> list[Escape]:
    worker_user_ns = os.readlink(f"/proc/{worker_pid}/ns/user")
    worker_pid_ns = os.readlink(f"/proc/{worker_pid}/ns/pid")
    workers = {worker_pid, *platform_pids}
    procs = {p.pid: p for p in (_read(pid) for pid in _pids()) if p is not None}
    marks = [c.encode() for c in canaries]
    wanted_displays = {d.split(".")[0] for d in displays}
    escapes = []
    for proc in procs.values():
        if proc.pid in workers:
            continue

        def escape(rule: str, proc: _Proc = proc) -> Escape:
            uid = proc.uids[0] if proc.uids else -1
            return Escape(proc.pid, proc.ppid, uid, proc.exe, proc.cmdline, rule, proc.started)

        for mark, canary in zip(marks, canaries, strict=True):
            if proc.environ is not None and mark in proc.environ:
                escapes.append(escape(f"(b) the worker's canary {canary!r} is in its environment"))
        if proc.started < since - 1e-6:
            continue
        # DISPLAY counts in the host's pid namespace only: a sandbox may name its display
        # differently inside (another desktop's sandbox seeing its own socket as :0).
        display = _display_of(proc.environ or b"") if proc.pid_ns == worker_pid_ns else None
        descends = _descends(proc.pid, procs, workers)
        if not descends and display not in wanted_displays:
            continue
        if proc.environ is None:
            escapes.append(escape("(b) its environment cannot be read: the canary is unchecked"))
        if proc.pid in xvfb_pids:
            continue
        why = f"descends from the worker {worker_pid}" if descends else f"DISPLAY={display}"
        problems = []
        if not proc.uids or any(uid not in sandbox_uids for uid in proc.uids):
            problems.append(
                f"uid {'/'.join(map(str, proc.uids))} is not a sandbox uid "
                f"({sandbox_uids.start}-{sandbox_uids.stop - 1})"
            )
        is_bwrap = os.path.basename(proc.exe) == "bwrap"
        for name, ns, worker_ns in (
            ("user", proc.user_ns, worker_user_ns),
            ("pid", proc.pid_ns, worker_pid_ns),
        ):
            if ns == "?":
                problems.append(f"its {name} namespace cannot be read")
            elif not is_bwrap and ns == worker_ns:
                problems.append(f"it shares the worker's {name} namespace")
        if problems:
            escapes.append(
                escape(f"(a) outside the sandbox ({why}, not Xvfb): {'; '.join(problems)}")
            )
    return sorted(escapes, key=lambda e: (e.pid, e.rule))


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _read(pid: int) -> _Proc | None:
    """What the check needs of one process; None for a vanished process, a zombie or a
    kernel thread."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        state, ppid, start_ticks = fields[0], int(fields[1]), int(fields[19])
        if state in ("Z", "X") or pid == 2 or ppid == 2:
            return None
        status = Path(f"/proc/{pid}/status").read_text()
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        uids = tuple(int(v) for v in uid_line.split()[1:])
        try:
            environ: bytes | None = Path(f"/proc/{pid}/environ").read_bytes()
        except PermissionError:  # a non-dumpable process (between setuid and exec, init)
            environ = None
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        exe = _link(f"/proc/{pid}/exe")
        user_ns = _link(f"/proc/{pid}/ns/user")
        pid_ns = _link(f"/proc/{pid}/ns/pid")
    except (FileNotFoundError, ProcessLookupError, StopIteration, ValueError, IndexError):
        return None
    return _Proc(
        pid=pid,
        ppid=ppid,
        uids=uids,
        started=start_ticks / CLOCK_TICKS,
        environ=environ,
        exe=exe,
        cmdline=cmdline.replace(b"\0", b" ").decode(errors="replace").strip(),
        user_ns=user_ns,
        pid_ns=pid_ns,
    )


def _link(path: str) -> str:
    """A /proc link's target; "?" where even root may not read it (a non-dumpable process)."""
    try:
        return os.readlink(path)
    except PermissionError:
        return "?"


def _display_of(environ: bytes) -> str | None:
    for entry in environ.split(b"\0"):
        if entry.startswith(b"DISPLAY="):
            return entry[len(b"DISPLAY=") :].decode(errors="replace").split(".")[0]
    return None


def _descends(pid: int, procs: dict[int, _Proc], ancestors: Collection[int]) -> bool:
    seen = set()
    while pid in procs and pid not in seen:
        seen.add(pid)
        pid = procs[pid].ppid
        if pid in ancestors:
            return True
    return False


def xvfb_display(pid: int) -> str | None:
    """The display (":7") of the Xvfb with this pid, from the X socket it listens on."""
    try:
        connections = psutil.Process(pid).net_connections(kind="unix")
    except psutil.Error:
        return None
    for conn in connections:
        path = conn.laddr if isinstance(conn.laddr, str) else ""
        name = path.rsplit("/", 1)[-1]
        if "/.X11-unix/" in path and name[1:].isdigit():
            return f":{name[1:]}"
    return None


def end_escapes(escapes: Collection[Escape]) -> list[int]:
    """SIGKILL the escaped processes that still run (same pid, same start time): processes
    our desktop started that its own close() may not reach. Returns the pids killed."""
    killed = []
    for e in escapes:
        proc = _read(e.pid)
        if proc is None or proc.started != e.started:
            continue
        try:
            os.kill(e.pid, 9)
        except ProcessLookupError:
            continue
        killed.append(e.pid)
    return killed
