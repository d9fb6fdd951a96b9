"""OSWorld result folders, read as demonstrations.

Every public OSWorld agent writes one folder per task,
`results/<action space>/<observation>/<model>/<domain>/<task id>/`, holding:
- `traj.jsonl`: a line per executed action: `step_num`, `action_timestamp`, `action`
  (pyautogui code, or WAIT / DONE / FAIL), `response` (the model's text, repeated on each
  action it carried), `reward`, `done`, `info`, `screenshot_file`;
- `step_<N>_<timestamp>.png`: the screen *after* that action;
- `result.txt`: the evaluator's score;
- `dartboard.json`, in Dartboard's own exports only: the task's Dartboard name and the
  instruction (OSWorld keeps those in its task files).

A folder of such folders is read at any depth: every folder holding a `traj.jsonl` is one
episode, its name the task id.

Which screen goes with which action: the screen before action N is the one saved after
action N-1. Before the first action OSWorld saves nothing; some agents write `step_0.png`
(or `step_0_<timestamp>.png`) and Dartboard's own export does: that screen is used. Without
it the first action has no screen it was chosen on, so it is left out, and the episode's
notes say so (the trajectory starts at its second action). Several Dartboard actions from
one line's code (a click, then typing) all go with the screen before that line: no screen
exists between them, and it is the screen the agent saw when it wrote them.

Coordinates: pyautogui's are the VM's screen pixels; a step's are its screenshot's. When the
screenshots were saved at another size than the screen (`screen`), points are rescaled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from datamanager.demos.episodes import (
    MAX_TEXT_BYTES,
    DemoEpisode,
    DemoFileError,
    DemoFiles,
    DemoStep,
    Shot,
    shot_read,
)
from datamanager.demos.pyautogui import PyautoguiError, PyautoguiReader

TRAJ = "traj.jsonl"
RESULT = "result.txt"
META = "dartboard.json"  # what Dartboard's own export adds: the task's name, the instruction
FIRST_SCREEN = re.compile(r"step_0(_[^/]*)?\.(png|jpe?g)", re.IGNORECASE)


@dataclass
class DemoRead:
    """What a reader found: the episodes, every problem (file and line first), and the
    episodes it passed over on purpose, with why."""

    episodes: list[DemoEpisode] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def osworld_folders(files: DemoFiles) -> list[str]:
    """The episode folders of a source: every folder holding a traj.jsonl ("" for the top)."""
    return sorted(
        str(PurePosixPath(name).parent) if "/" in name else ""
        for name in files.names()
        if PurePosixPath(name).name == TRAJ
    )


def osworld_read(files: DemoFiles, *, screen: tuple[int, int] | None = None) -> DemoRead:
    """Every episode folder of `files`, checked; nothing is stored."""
    out = DemoRead()
    folders = osworld_folders(files)
    if not folders:
        out.errors.append(f"{files.label}: no {TRAJ} in it or in any folder below it")
        return out
    names = set(files.names())
    for folder in folders:
        before = len(out.errors)
        episode = _episode(files, folder, names, screen, out)
        if episode is not None and len(out.errors) == before:
            out.episodes.append(episode)
    return out


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _episode(
    files: DemoFiles, folder: str, names: set[str], screen: tuple[int, int] | None, out: DemoRead
) -> DemoEpisode | None:
    where = folder or files.label
    task_id = PurePosixPath(folder).name if folder else PurePosixPath(files.label).name
    traj_name = _join(folder, TRAJ)
    records = _records(files, traj_name, out)
    if records is None:
        return None
    failed = [(n, rec["Error"]) for n, rec in records if "Error" in rec]
    if failed:
        n, error = failed[0]
        out.skipped.append(
            f"{traj_name}:{n}: the agent's run failed here ({str(error)[:120]}): "
            "not a demonstration"
        )
        return None
    reward = _result(files, _join(folder, RESULT), names, out)
    instruction = ""
    if _join(folder, META) in names:
        meta = _meta(files, _join(folder, META), out)
        task_id = meta.get("task") or task_id
        instruction = meta.get("instruction") or ""
    first = sorted(
        n
        for n in names
        if n.startswith(_join(folder, "")) and FIRST_SCREEN.fullmatch(n[len(_join(folder, "")) :])
    )
    notes: list[str] = []
    shot: Shot | None = None
    if first:
        shot = _shot(files, first[0], out)
    else:
        notes.append(
            "no step_0 screenshot (the screen before the first action): the first action "
            "is left out"
        )
    steps: list[DemoStep] = []
    reader: PyautoguiReader | None = None
    for line_no, rec in records:
        at = f"{traj_name}:{line_no}"
        code = rec.get("action")
        after_name = rec.get("screenshot_file")
        if not isinstance(code, str):
            out.errors.append(
                f"{at}: action is {type(code).__name__}, not pyautogui code or WAIT/DONE/FAIL "
                "(only the pyautogui action space is read)"
            )
            continue
        last = line_no == records[-1][0]
        if not last and (not isinstance(after_name, str) or not after_name):
            out.errors.append(
                f"{at}: no screenshot_file (the screen the next action was chosen on)"
            )
            continue
        response = rec.get("response", "")
        thought = response if isinstance(response, str) else json.dumps(response)
        after = None if last else _shot(files, _join(folder, str(after_name)), out)
        sized = shot or after
        if sized is None:
            shot = after
            continue
        if reader is None:
            reader = _reader(sized, screen)
        try:
            # Parsed even when its screen is missing: it may move the cursor later ones use.
            actions = reader.actions(code)
        except PyautoguiError as exc:
            out.errors.append(f"{at}: {exc}")
            actions = []
        if shot is not None:
            steps += [
                DemoStep(shot=shot, action=a, thought=thought, source=at, recorded=code)
                for a in actions
            ]
        shot = after
    if reward is None:
        return None
    if not steps and not any(e.startswith(traj_name) for e in out.errors):
        out.errors.append(f"{traj_name}: no action with a screen before it")
        return None
    return DemoEpisode(
        task_key=task_id,
        instruction=instruction,
        reward=reward,
        steps=steps,
        source=where,
        notes=notes,
    )


def _reader(shot: Shot, screen: tuple[int, int] | None) -> PyautoguiReader:
    width, height = screen or (shot.width, shot.height)
    return PyautoguiReader(
        scale=(shot.width / width, shot.height / height), screen=(shot.width, shot.height)
    )


def _records(files: DemoFiles, name: str, out: DemoRead) -> list[tuple[int, dict]] | None:
    try:
        text = files.read(name, limit=MAX_TEXT_BYTES).decode("utf-8")
    except (DemoFileError, UnicodeDecodeError) as exc:
        out.errors.append(f"{name}: {exc}")
        return None
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            out.errors.append(f"{name}:{n}: not JSON ({exc})")
            continue
        if not isinstance(rec, dict):
            out.errors.append(f"{name}:{n}: not a JSON object")
            continue
        records.append((n, rec))
    if not records and not any(e.startswith(name) for e in out.errors):
        out.errors.append(f"{name}: no actions in it")
    return records


def _meta(files: DemoFiles, name: str, out: DemoRead) -> dict[str, str]:
    try:
        meta = json.loads(files.read(name, limit=1024 * 1024).decode("utf-8"))
    except (DemoFileError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        out.errors.append(f"{name}: not readable JSON ({exc})")
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        out.errors.append(f"{name}: must be an object of strings (task, instruction)")
        return {}
    return meta


def _result(files: DemoFiles, name: str, names: set[str], out: DemoRead) -> float | None:
    if name not in names:
        out.errors.append(f"{name}: missing (the episode was never scored)")
        return None
    try:
        value = float(files.read(name, limit=1024).decode("utf-8").strip())
    except (DemoFileError, UnicodeDecodeError, ValueError) as exc:
        out.errors.append(f"{name}: not a score ({exc})")
        return None
    if not 0.0 <= value <= 1.0:
        out.errors.append(f"{name}: score {value} is outside [0, 1]")
        return None
    return value


def _shot(files: DemoFiles, name: str, out: DemoRead) -> Shot | None:
    try:
        return shot_read(files, name)
    except DemoFileError as exc:
        out.errors.append(f"{name}: {exc}")
        return None


@dataclass(frozen=True)
class OsworldStep:
    """One stored step as the OSWorld writer needs it."""

    png: bytes  # the screen the action was chosen on
    code: str  # pyautogui code, or WAIT / DONE / FAIL
    response: str


def osworld_write(
    folder: Path, *, steps: list[OsworldStep], score: float, task: str, instruction: str
) -> None:
    """One episode as OSWorld's lib_run_single writes it, plus `step_0.png` (the screen before
    the first action, which OSWorld itself does not save) and `dartboard.json` (the task's
    Dartboard name and the instruction, which OSWorld keeps in its task files). Dartboard
    keeps no screen after the last action, so the last line names none."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / META).write_text(json.dumps({"task": task, "instruction": instruction}))
    (folder / "step_0.png").write_bytes(steps[0].png if steps else b"")
    lines = []
    for i, step in enumerate(steps, start=1):
        stamp = f"00000000@{i:06d}"  # OSWorld's action_timestamp layout; Dartboard keeps no wall time per action here
        shot = ""
        if i < len(steps):
            shot = f"step_{i}_{stamp}.png"
            (folder / shot).write_bytes(steps[i].png)  # the screen after action i
        lines.append(
            json.dumps(
                {
                    "step_num": i,
                    "action_timestamp": stamp,
                    "action": step.code,
                    "response": step.response,
                    "reward": 0,
                    "done": i == len(steps),
                    "info": {},
                    "screenshot_file": shot,
                }
            )
        )
    (folder / TRAJ).write_text("".join(line + "\n" for line in lines))
    (folder / RESULT).write_text(f"{score}\n")
