"""Desktop tasks: structured setup steps, a checker of the resulting state, an oracle plan.

Setup comes only from these definitions (never from model output): write fixture files into
the task's sandbox directory and launch apps with fixed argv and window geometry. Apps are
xterm, chromium (--app mode) and `dartapp.py`, a small Tk program (editor, drag board, mouse
pad, long text) whose source lives here and is written into the sandbox at each reset; it
runs on the venv's Python, which has Tk 8.6.

Checkers inspect state a user would check: a file's content, a window's title.

    .venv/bin/python -c "from envmanager.desktop_tasks import desktop_task_records as r; print(r())"
"""

from __future__ import annotations

import os
import pathlib
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.protocol import Action, ActionType, Evaluation

# ------------------------------------------------------------------ the Tk fixture app

DARTAPP = r"""
import sys, tkinter as tk

mode, out = sys.argv[1], sys.argv[2]
root = tk.Tk()
root.geometry("800x560+0+0")

def write(text):
    with open(out, "w") as f:
        f.write(text)

if mode == "edit":
    name = out.rsplit("/", 1)[-1]
    root.title("dartedit - " + name)
    text = tk.Text(root, font=("DejaVu Sans Mono", 14), undo=True)
    text.pack(fill="both", expand=True)
    with open(out) as f:
        text.insert("1.0", f.read())
    def select_all(event):
        text.tag_add("sel", "1.0", "end-1c")
        return "break"
    def save(event):
        write(text.get("1.0", "end-1c"))
        root.title("dartedit - " + name + " (saved)")
        return "break"
    text.bind("<Control-a>", select_all)
    text.bind("<Control-s>", save)
    text.mark_set("insert", "1.0")
    text.focus_set()
elif mode == "drag":
    root.title("dartdrag")
    canvas = tk.Canvas(root, width=800, height=560, bg="white")
    canvas.pack()
    canvas.create_rectangle(500, 160, 700, 360, outline="blue", width=3)
    canvas.create_text(600, 140, text="drop here", font=("DejaVu Sans", 14))
    square = canvas.create_rectangle(80, 200, 160, 280, fill="red")
    state = {"x": None, "y": None}
    def press(e):
        if canvas.find_withtag("current") == (square,):
            state["x"], state["y"] = e.x, e.y
    def motion(e):
        if state["x"] is not None:
            canvas.move(square, e.x - state["x"], e.y - state["y"])
            state["x"], state["y"] = e.x, e.y
    def release(e):
        if state["x"] is None:
            return
        state["x"] = None
        x0, y0, x1, y1 = canvas.coords(square)
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        if 500 <= cx <= 700 and 160 <= cy <= 360:
            write("dropped")
            root.title("dartdrag - dropped")
    canvas.bind("<ButtonPress-1>", press)
    canvas.bind("<B1-Motion>", motion)
    canvas.bind("<ButtonRelease-1>", release)
elif mode in ("double", "right"):
    root.title("dartpad")
    label = tk.Label(root, text=mode + "-click me", font=("DejaVu Sans", 24), bg="lightyellow")
    label.pack(fill="both", expand=True)
    label.bind("<Double-Button-1>" if mode == "double" else "<Button-3>", lambda e: write(mode))
elif mode == "longtext":
    root.title("dartread")
    text = tk.Text(root, font=("DejaVu Sans Mono", 14))
    text.pack(fill="both", expand=True)
    text.insert("1.0", "\n".join(f"line {i}" for i in range(1, 81)) + "\nTHE END")
    text.configure(state="disabled")
    def poll():
        if text.yview()[1] >= 1.0:
            write("bottom")
        root.after(100, poll)
    poll()
root.mainloop()
"""

CHROMIUM_PAGE = """<!doctype html><html><head><title>DartPage</title></head>
<body style="margin:0">
<button id="go" style="width:100%;height:400px;margin-top:60px;font-size:40px"
  onclick="document.title='Clicked'">Click me</button>
</body></html>"""

# ------------------------------------------------------------------ setup and state


@dataclass(frozen=True)
class WriteFile:
    """Write `content` to sandbox/`path` before the apps start."""

    path: str
    content: str


@dataclass(frozen=True)
class Launch:
    """Start `argv` in the sandbox and wait until a window titled like `window` shows.

    argv items may use {sandbox}, {python} (the venv interpreter) and {app} (dartapp.py).
    """

    argv: tuple[str, ...]
    window: str


SetupStep = WriteFile | Launch


@dataclass(frozen=True)
class DesktopState:
    """What a checker may look at after the episode."""

    sandbox: pathlib.Path
    window_titles: list[str]


@dataclass(frozen=True)
class DesktopTask:
    name: str
    instruction: str
    setup: tuple[SetupStep, ...]
    checker: Callable[[DesktopState], Evaluation]
    oracle_plan: tuple[Action, ...]
    tags: tuple[str, ...] = ()
    split: str = "train"
    extra: dict[str, Any] = field(default_factory=dict)


MAX_CHECKED_BYTES = 64 * 1024  # a checker reads at most this much of a task file


class TaskFileRefused(Exception):
    """A task file the checker will not read; the message says why."""


def read_task_file(directory: Path, name: str) -> str | None:
    """The text of `name` in the task directory, or None when it does not exist.

    The sandboxed agent owns the directory and can put anything there: the file is opened
    without following a symlink, must be a regular file, and at most MAX_CHECKED_BYTES are
    read (`ln -s /dev/zero done.txt` or a link to a secret is refused, never read)."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symlink
            raise TaskFileRefused(f"{name} is a symlink or unreadable ({exc.strerror})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TaskFileRefused(f"{name} is not a regular file")
            data = os.read(fd, MAX_CHECKED_BYTES + 1)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    if len(data) > MAX_CHECKED_BYTES:
        raise TaskFileRefused(f"{name} is larger than {MAX_CHECKED_BYTES} bytes")
    return data.decode(errors="replace")


def file_equals(path: str, expected: str) -> Callable[[DesktopState], Evaluation]:
    """Checker: the task file exists and its text (trailing whitespace stripped) == expected."""

    def check(state: DesktopState) -> Evaluation:
        try:
            text = read_task_file(state.sandbox, path)
        except TaskFileRefused as exc:
            return Evaluation(reward=0.0, success=False, details={"reason": str(exc)})
        if text is None:
            return Evaluation(reward=0.0, success=False, details={"reason": f"{path} missing"})
        got = text.rstrip()
        ok = got == expected
        return Evaluation(
            reward=1.0 if ok else 0.0,
            success=ok,
            details={"reason": "content matches" if ok else "content differs", "content": got},
        )

    return check


def window_titled(title: str) -> Callable[[DesktopState], Evaluation]:
    """Checker: a visible window's title starts with `title`."""

    def check(state: DesktopState) -> Evaluation:
        ok = any(t.startswith(title) for t in state.window_titles)
        return Evaluation(
            reward=1.0 if ok else 0.0,
            success=ok,
            details={
                "reason": f"window {title!r} {'found' if ok else 'missing'}",
                "windows": state.window_titles,
            },
        )

    return check


# ------------------------------------------------------------------ the tasks

_APP = "{python}", "{app}"
_XTERM = (
    "xterm",
    "-geometry",
    "100x30+0+0",
    "-T",
    "dart-term",
    "-e",
    "bash",
    "--norc",
    "--noprofile",
)
# --no-sandbox: chromium's own sandbox needs user namespaces or a setuid helper, neither of
# which it gets inside bubblewrap; the bubblewrap sandbox around it is the isolation.
_CHROMIUM = (
    "chromium",
    "--app=file://{sandbox}/page.html",
    "--user-data-dir=/home/agent/.chromium",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--no-first-run",
    "--no-default-browser-check",
    "--window-position=0,0",
    "--window-size=800,600",
)


def _a(type_: str, **kw: Any) -> Action:
    return Action(type=ActionType(type_), **kw)


_DONE = _a("finished", text="done")

DESKTOP_TASKS: dict[str, DesktopTask] = {
    t.name: t
    for t in [
        DesktopTask(
            name="desktop/editor-type-save",
            instruction="Type 'hello desktop' into the editor and save the file with Ctrl+S.",
            setup=(
                WriteFile("notes.txt", ""),
                Launch((*_APP, "edit", "{sandbox}/notes.txt"), "dartedit"),
            ),
            checker=file_equals("notes.txt", "hello desktop"),
            oracle_plan=(
                _a("click", x=400, y=300),
                _a("type", text="hello desktop"),
                _a("hotkey", key="ctrl s"),
                _DONE,
            ),
            tags=("type", "hotkey", "editor", "easy"),
        ),
        DesktopTask(
            name="desktop/editor-clear-save",
            instruction="Delete all the text in the editor and save the empty file with Ctrl+S.",
            setup=(
                WriteFile("draft.txt", "remove me\nand me too\n"),
                Launch((*_APP, "edit", "{sandbox}/draft.txt"), "dartedit"),
            ),
            checker=file_equals("draft.txt", ""),
            oracle_plan=(
                _a("click", x=400, y=300),
                _a("hotkey", key="ctrl a"),
                _a("hotkey", key="delete"),
                _a("hotkey", key="ctrl s"),
                _DONE,
            ),
            tags=("hotkey", "editor"),
        ),
        DesktopTask(
            name="desktop/editor-append-line",
            instruction="Add a second line 'second line' at the end of the file and save it.",
            setup=(
                WriteFile("list.txt", "first line\n"),
                Launch((*_APP, "edit", "{sandbox}/list.txt"), "dartedit"),
            ),
            checker=file_equals("list.txt", "first line\nsecond line"),
            oracle_plan=(
                _a("click", x=400, y=300),
                _a("hotkey", key="ctrl end"),
                _a("type", text="second line"),
                _a("hotkey", key="ctrl s"),
                _DONE,
            ),
            tags=("type", "hotkey", "editor"),
            split="eval",
        ),
        DesktopTask(
            name="desktop/xterm-create-file",
            instruction="Using the terminal, create a file named done.txt containing the word ok.",
            setup=(Launch(_XTERM, "dart-term"),),
            checker=file_equals("done.txt", "ok"),
            oracle_plan=(_a("click", x=300, y=200), _a("type", text="echo ok > done.txt\n"), _DONE),
            tags=("type", "terminal", "easy"),
        ),
        DesktopTask(
            name="desktop/xterm-set-title",
            instruction="Change the terminal window's title to 'dart-title'.",
            setup=(Launch(_XTERM, "dart-term"),),
            checker=window_titled("dart-title"),
            oracle_plan=(
                _a("click", x=300, y=200),
                _a("type", text="printf '\\033]0;dart-title\\007'\n"),
                _DONE,
            ),
            tags=("type", "terminal"),
            split="eval",
        ),
        DesktopTask(
            name="desktop/chromium-click-button",
            instruction="Click the 'Click me' button on the web page.",
            setup=(WriteFile("page.html", CHROMIUM_PAGE), Launch(_CHROMIUM, "DartPage")),
            checker=window_titled("Clicked"),
            oracle_plan=(_a("click", x=400, y=300), _DONE),
            tags=("click", "browser", "easy"),
        ),
        DesktopTask(
            name="desktop/drag-square",
            instruction="Drag the red square into the blue 'drop here' box.",
            setup=(Launch((*_APP, "drag", "{sandbox}/drag.txt"), "dartdrag"),),
            checker=file_equals("drag.txt", "dropped"),
            oracle_plan=(_a("drag", x=120, y=262, x2=600, y2=282), _DONE),
            tags=("drag",),
        ),
        DesktopTask(
            name="desktop/double-click",
            instruction="Double-click the yellow area.",
            setup=(Launch((*_APP, "double", "{sandbox}/pad.txt"), "dartpad"),),
            checker=file_equals("pad.txt", "double"),
            oracle_plan=(_a("left_double", x=400, y=300), _DONE),
            tags=("click", "easy"),
        ),
        DesktopTask(
            name="desktop/right-click",
            instruction="Right-click the yellow area.",
            setup=(Launch((*_APP, "right", "{sandbox}/pad.txt"), "dartpad"),),
            checker=file_equals("pad.txt", "right"),
            oracle_plan=(_a("right_single", x=400, y=300), _DONE),
            tags=("click", "easy"),
        ),
        DesktopTask(
            name="desktop/scroll-to-end",
            instruction="Scroll the text down until its last line, THE END, is visible.",
            setup=(Launch((*_APP, "longtext", "{sandbox}/read.txt"), "dartread"),),
            checker=file_equals("read.txt", "bottom"),
            oracle_plan=(*[_a("scroll", x=400, y=300, direction="down")] * 12, _DONE),
            tags=("scroll",),
            split="eval",
        ),
    ]
}


def desktop_task(*, name: str) -> DesktopTask:
    try:
        return DESKTOP_TASKS[name]
    except KeyError:
        raise ValueError(f"unknown desktop task {name!r}; known: {sorted(DESKTOP_TASKS)}") from None


def desktop_oracle_plan(*, name: str) -> tuple[Action, ...]:
    """The fixed action sequence that solves `name` (indexed by observation step)."""
    return desktop_task(name=name).oracle_plan


def desktop_task_records() -> list[dict[str, Any]]:
    """Import records: name, env_kind "desktop", env_config {"task": name}, instruction, split, tags."""
    return [
        {
            "name": t.name,
            "env_kind": "desktop",
            "env_config": {"task": t.name},
            "instruction": t.instruction,
            "split": t.split,
            "tags": list(t.tags),
        }
        for t in DESKTOP_TASKS.values()
    ]
