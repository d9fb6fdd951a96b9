"""The upload archive of pre-collected trajectories: format and validation.

Format: a .zip holding `manifest.json` and the screenshots it names.

    manifest.json = [
      {"task": "click-button",            # an existing Task name
       "reward": 1.0,                     # number in [0, 1]
       "instruction": "Click OK",         # optional, the instruction the demo followed
       "steps": [                         # at least one
         {"screenshot": "shots/0.png",    # a PNG inside the zip
          "action": {"type": "click", "x": 40, "y": 80},   # envmanager Action JSON
          "thought": "The OK button",     # optional
          "raw_output": "..."}            # optional; else format_action(action, thought)
       ]}
    ]

`archive_read` validates everything (JSON, fields, task names, actions, that each PNG opens)
before anything is written, and reports every problem with the file and field it is in.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from typing import IO, Any

from PIL import Image

from core.actions import format_action
from core.protocol import Action

MANIFEST = "manifest.json"
MAX_MEMBER_BYTES = 20 * 1024 * 1024
MAX_TRAJECTORIES = 5000
MAX_ERRORS = 50


class InvalidUpload(ValueError):
    """The archive is not importable. `errors` lists every problem ("file: field: why")."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class ArchiveStep:
    screenshot: str
    png: bytes
    width: int
    height: int
    action: dict[str, Any]
    thought: str
    raw_output: str


@dataclass(frozen=True)
class ArchiveTrajectory:
    task: str
    reward: float
    instruction: str
    steps: list[ArchiveStep] = field(default_factory=list)


def archive_read(*, fileobj: IO[bytes], known_tasks: set[str]) -> list[ArchiveTrajectory]:
    """Parse and validate an upload; raise InvalidUpload listing every problem found."""
    try:
        zf = zipfile.ZipFile(fileobj)
    except zipfile.BadZipFile:
        raise InvalidUpload(["upload: not a .zip archive"]) from None
    with zf:
        names = {i.filename: i for i in zf.infolist() if not i.is_dir()}
        if MANIFEST not in names:
            raise InvalidUpload([f"upload: no {MANIFEST} at the top of the archive"])
        try:
            manifest = json.loads(zf.read(MANIFEST).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidUpload([f"{MANIFEST}: not valid JSON ({exc})"]) from None
        if not isinstance(manifest, list) or not manifest:
            raise InvalidUpload([f"{MANIFEST}: must be a non-empty list of trajectories"])
        if len(manifest) > MAX_TRAJECTORIES:
            raise InvalidUpload([f"{MANIFEST}: at most {MAX_TRAJECTORIES} trajectories"])
        errors: list[str] = []
        out = []
        for i, item in enumerate(manifest):
            traj = _trajectory(zf, names, item, f"{MANIFEST}: [{i}]", known_tasks, errors)
            if traj is not None:
                out.append(traj)
            if len(errors) >= MAX_ERRORS:
                errors.append("... (more errors not shown)")
                break
        if errors:
            raise InvalidUpload(errors)
        return out


def _trajectory(zf, names, item, where, known_tasks, errors) -> ArchiveTrajectory | None:
    if not isinstance(item, dict):
        errors.append(f"{where}: must be an object")
        return None
    n_before = len(errors)
    unknown = sorted(set(item) - {"task", "reward", "instruction", "steps"})
    if unknown:
        errors.append(f"{where}: unknown field(s) {unknown}")
    task = item.get("task")
    if not isinstance(task, str) or not task:
        errors.append(f"{where}.task: must be a task name")
    elif task not in known_tasks:
        errors.append(f"{where}.task: no task named {task!r}; import it first")
    reward = item.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not 0 <= reward <= 1:
        errors.append(f"{where}.reward: must be a number in [0, 1], got {reward!r}")
    instruction = item.get("instruction", "")
    if not isinstance(instruction, str):
        errors.append(f"{where}.instruction: must be a string")
    steps_raw = item.get("steps")
    if not isinstance(steps_raw, list) or not steps_raw:
        errors.append(f"{where}.steps: must be a non-empty list")
        return None
    steps = [_step(zf, names, s, f"{where}.steps[{j}]", errors) for j, s in enumerate(steps_raw)]
    if len(errors) > n_before:
        return None
    # No new error: every check above passed (and _step returns None only with an error).
    valid = [s for s in steps if s is not None]
    assert isinstance(task, str) and isinstance(reward, int | float) and len(valid) == len(steps)
    return ArchiveTrajectory(task=task, reward=float(reward), instruction=instruction, steps=valid)


def _step(zf, names, item, where, errors) -> ArchiveStep | None:
    if not isinstance(item, dict):
        errors.append(f"{where}: must be an object")
        return None
    n_before = len(errors)
    unknown = sorted(set(item) - {"screenshot", "action", "thought", "raw_output"})
    if unknown:
        errors.append(f"{where}: unknown field(s) {unknown}")
    path = item.get("screenshot")
    png = b""
    width = height = 0
    if not isinstance(path, str) or not path:
        errors.append(f"{where}.screenshot: must be a path inside the zip")
    elif path not in names:
        errors.append(f"{where}.screenshot: {path!r} is not in the archive")
    elif names[path].file_size > MAX_MEMBER_BYTES:
        errors.append(f"{path}: larger than {MAX_MEMBER_BYTES // 2**20} MiB")
    else:
        png = zf.read(path)
        try:
            with Image.open(io.BytesIO(png)) as img:
                if img.format != "PNG":
                    raise ValueError(f"is {img.format}, not PNG")
                img.verify()
                width, height = img.size
        except Exception as exc:
            errors.append(f"{path}: not a readable PNG ({exc})")
    action_raw = item.get("action")
    action = None
    if not isinstance(action_raw, dict):
        errors.append(f"{where}.action: must be an action object, e.g. {{'type': 'click', ...}}")
    else:
        try:
            action = Action.from_json(action_raw)
        except (TypeError, ValueError) as exc:
            errors.append(f"{where}.action: {exc}")
    thought = item.get("thought", "")
    if not isinstance(thought, str):
        errors.append(f"{where}.thought: must be a string")
        thought = ""
    raw_output = item.get("raw_output")
    if raw_output is not None and not isinstance(raw_output, str):
        errors.append(f"{where}.raw_output: must be a string")
    if action is not None and raw_output is None:
        try:
            raw_output = format_action(action, thought=thought)
        except ValueError as exc:
            errors.append(f"{where}.action: cannot be formatted ({exc})")
    if len(errors) > n_before or action is None:
        return None
    assert isinstance(path, str)  # no new error: the screenshot check passed
    return ArchiveStep(
        screenshot=path,
        png=png,
        width=width,
        height=height,
        action=action.to_json(),
        thought=thought,
        raw_output=raw_output or "",
    )
