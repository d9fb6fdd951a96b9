"""Scripted solutions of the OSWorld-format tasks in tasks/osworld/, as Dartboard Actions.

Each plan is what a perfect agent does on a Dartboard desktop serving OSWorld's protocol
(envmanager.osworld_server, 1024x768): the tasks open their windows at fixed places (xterm
at the top left, the Tk editor at 800x560+0+0, chromium full screen with the page's controls
at fixed CSS positions), so a plan is a fixed list replayed by the observation's step
number, like the desktop tasks' (envmanager.oracles). Plans are in screenshot pixels; the
backend scales them to the VM's screen. Chromium shows an infobar about --no-sandbox that
pushes pages down 78 px; the browser plans click where the page's controls are then.
The shell plans avoid '<': pyautogui's typewrite on Xvfb types it as '>' (seen: `wc -l <
data.csv` became `wc -l > data.csv`).

    .venv/bin/python -c "from envmanager.osworld_oracles import OSWORLD_PLANS; print(sorted(OSWORLD_PLANS))"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.protocol import Action, ActionType

TASKS_DIR = Path(__file__).resolve().parent.parent / "tasks" / "osworld"


def _a(type_: str, **kw: Any) -> Action:
    return Action(type=ActionType(type_), **kw)


_TERM = _a("click", x=300, y=200)  # focus the xterm (100x30 at the top left)
_EDIT = _a("click", x=400, y=300)  # focus the Tk editor's text
_DONE = _a("finished", text="done")


def _shell(line: str) -> tuple[Action, ...]:
    return (_TERM, _a("type", text=line + "\n"), _a("wait"), _DONE)


OSWORLD_PLANS: dict[str, tuple[Action, ...]] = {
    "osworld/dartboard-terminal-hello-file": _shell("echo 'hello osworld' > ~/hello.txt"),
    "osworld/dartboard-terminal-mkdir": _shell("mkdir ~/projects"),
    "osworld/dartboard-terminal-rename": _shell("mv report-draft.txt report-final.txt"),
    "osworld/dartboard-terminal-delete-log": _shell("rm junk.log"),
    "osworld/dartboard-terminal-count-lines": _shell("cat data.csv | wc -l > count.txt"),
    "osworld/dartboard-terminal-python-script": _shell(
        "printf 'print(\"Hello, Dartboard!\")\\n' > greet.py"
    ),
    "osworld/dartboard-editor-type-save": (
        _EDIT,
        _a("type", text="meeting at noon"),
        _a("hotkey", key="ctrl s"),
        _DONE,
    ),
    "osworld/dartboard-editor-append-line": (
        _EDIT,
        _a("hotkey", key="ctrl end"),
        _a("type", text="\nsecond line"),
        _a("hotkey", key="ctrl s"),
        _DONE,
    ),
    "osworld/dartboard-editor-replace-word": (
        _EDIT,
        _a("hotkey", key="ctrl a"),
        _a("type", text="The sky is blue."),
        _a("hotkey", key="ctrl s"),
        _DONE,
    ),
    "osworld/dartboard-browser-place-order": (_a("click", x=400, y=380), _a("wait"), _DONE),
    "osworld/dartboard-browser-greet": (
        _a("click", x=400, y=220),
        _a("type", text="Ada"),
        _a("click", x=400, y=450),
        _a("wait"),
        _DONE,
    ),
    "osworld/dartboard-infeasible-spotify": (_a("call_user"),),
}


def osworld_task_files() -> list[Path]:
    """The shipped OSWorld-format task files."""
    return sorted(TASKS_DIR.glob("*.json"))
