"""AgentNet (OpenCUA's data set) lines, read as demonstrations.

A .jsonl file holds one task a line: `task_id`, `instruction`, `task_completed` and quality
scores (`alignment_score`, `efficiency_score`, `task_difficulty`), and `traj`, a list of
steps `{"index", "image", "value": {"code", "thought", "action", "observation", ...}}`.
`image` names the screenshot the annotator acted on (the screen *before* the step's code),
a file somewhere in the source (found by its path, else by its base name); `code` is
pyautogui with coordinates as fractions of the screen, or `computer.terminate(...)`.

The reward is 1 for `task_completed`, else 0. A step's code with several actions gives
several Dartboard steps, all on the step's screenshot (none exists between them).
"""

from __future__ import annotations

import json
from pathlib import PurePosixPath
from typing import Any

from datamanager.demos.episodes import (
    DemoEpisode,
    DemoFileError,
    DemoFiles,
    DemoStep,
    Shot,
    shot_read,
)
from datamanager.demos.osworld import DemoRead
from datamanager.demos.pyautogui import PyautoguiError, PyautoguiReader

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp"}  # IMAGE_FORMATS' file names


def agentnet_read(files: DemoFiles) -> DemoRead:
    """Every line of every .jsonl file in `files`, checked; nothing is stored."""
    out = DemoRead()
    names = files.names()
    jsonl = [n for n in names if n.endswith(".jsonl")]
    if not jsonl:
        out.errors.append(f"{files.label}: no .jsonl file in it")
        return out
    images = _image_index(names)
    for name in jsonl:
        try:
            for line_no, raw in files.lines(name):
                if raw.strip():
                    _line(files, f"{name}:{line_no}", raw, images, out)
        except DemoFileError as exc:
            out.errors.append(f"{name}: {exc}")
    return out


def _image_index(names: list[str]) -> dict[str, list[str]]:
    """Base name -> the image files of that name."""
    index: dict[str, list[str]] = {}
    for name in names:
        path = PurePosixPath(name)
        if path.suffix.lower() in IMAGE_SUFFIXES:
            index.setdefault(path.name, []).append(name)
    return index


def _line(
    files: DemoFiles, at: str, raw: bytes, images: dict[str, list[str]], out: DemoRead
) -> None:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        out.errors.append(f"{at}: not JSON ({exc})")
        return
    if not isinstance(rec, dict):
        out.errors.append(f"{at}: not a JSON object")
        return
    task_id, instruction, traj = rec.get("task_id"), rec.get("instruction"), rec.get("traj")
    before = len(out.errors)
    if not isinstance(task_id, str | int) or isinstance(task_id, bool) or not str(task_id):
        out.errors.append(f"{at}: task_id must be a string")
    if not isinstance(instruction, str):
        out.errors.append(f"{at}: instruction must be a string")
    if not isinstance(traj, list) or not traj:
        out.errors.append(f"{at}: traj must be a non-empty list of steps")
    completed = rec.get("task_completed")
    if not isinstance(completed, bool):
        out.errors.append(f"{at}: task_completed must be true or false")
    if len(out.errors) > before:
        return
    assert isinstance(traj, list) and isinstance(instruction, str)
    steps: list[DemoStep] = []
    reader: PyautoguiReader | None = None
    for j, item in enumerate(traj):
        where = f"{at}: traj[{j}]"
        shot, code, thought = _step_parts(files, where, item, images, out)
        if shot is None or code is None:
            continue
        if reader is None:
            reader = PyautoguiReader(
                scale=(shot.width, shot.height), screen=(shot.width, shot.height)
            )
        try:
            actions = reader.actions(code)
        except PyautoguiError as exc:
            out.errors.append(f"{where}.value.code: {exc}")
            continue
        steps += [
            DemoStep(shot=shot, action=a, thought=thought, source=where, recorded=code)
            for a in actions
        ]
    if len(out.errors) > before:
        return
    scores = {
        k: rec[k]
        for k in ("alignment_score", "efficiency_score", "task_difficulty")
        if isinstance(rec.get(k), int | float)
    }
    notes = [f"AgentNet scores: {json.dumps(scores)}"] if scores else []
    out.episodes.append(
        DemoEpisode(
            task_key=str(task_id),
            instruction=instruction,
            reward=1.0 if completed else 0.0,
            steps=steps,
            source=at,
            notes=notes,
        )
    )


def _step_parts(
    files: DemoFiles, where: str, item: Any, images: dict[str, list[str]], out: DemoRead
) -> tuple[Shot | None, str | None, str]:
    if not isinstance(item, dict) or not isinstance(item.get("value"), dict):
        out.errors.append(f"{where}: must be an object with a 'value' object")
        return None, None, ""
    value = item["value"]
    code = value.get("code")
    if not isinstance(code, str) or not code.strip():
        out.errors.append(f"{where}.value.code: must be pyautogui code")
        code = None
    thought = value.get("thought", "")
    thought = thought if isinstance(thought, str) else ""
    image = item.get("image")
    if not isinstance(image, str) or not image:
        out.errors.append(f"{where}.image: must name the step's screenshot")
        return None, code, thought
    try:
        return shot_read(files, _find(image, images)), code, thought
    except DemoFileError as exc:
        out.errors.append(f"{where}.image: {image}: {exc}")
        return None, code, thought


def _find(image: str, images: dict[str, list[str]]) -> str:
    """The source's file for an `image` field; DemoFileError when there is none or several."""
    matches = images.get(PurePosixPath(image).name, [])
    exact = [m for m in matches if m == image or m.endswith("/" + image)]
    if len(exact) == 1:
        return exact[0]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise DemoFileError("is not in the source (no image file of that name)")
    raise DemoFileError(
        f"is ambiguous: {len(matches)} files of that name ({', '.join(matches[:3])})"
    )
