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
Limits keep one upload from exhausting the web process: the manifest's size, the
uncompressed bytes read in all, the steps, and each PNG's size and pixels. A PNG named by
many steps is read and checked once; a corrupt, encrypted or CRC-failing member is reported
at the member, like any other problem.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import IO, Any

from PIL import Image

from core.actions import format_action
from core.protocol import Action

MANIFEST = "manifest.json"
MAX_UPLOAD_BYTES = 256 * 1024 * 1024  # the .zip itself
MAX_MANIFEST_BYTES = 8 * 1024 * 1024
MAX_MEMBER_BYTES = 20 * 1024 * 1024  # one PNG
MAX_TOTAL_BYTES = 512 * 1024 * 1024  # every member read, uncompressed
MAX_PNG_PIXELS = 4096 * 4096
MAX_TRAJECTORIES = 5000
MAX_STEPS = 50_000  # in all trajectories
MAX_ERRORS = 50
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, RuntimeError, NotImplementedError,
              EOFError, OSError, zlib.error)  # fmt: skip


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


class _Members:
    """Reads members of the zip once each, within the size budgets."""

    def __init__(self, zf: zipfile.ZipFile) -> None:
        self.zf = zf
        self.names = {i.filename: i for i in zf.infolist() if not i.is_dir()}
        self.total = 0
        self.pngs: dict[str, tuple[bytes, int, int] | str] = {}  # path -> PNG or error

    def read(self, path: str, *, limit: int) -> bytes:
        """The member's bytes; raises InvalidUpload-worthy ValueError with the reason."""
        info = self.names[path]
        if info.file_size > limit:
            raise ValueError(f"larger than {limit // 2**20} MiB")
        if self.total + info.file_size > MAX_TOTAL_BYTES:
            raise ValueError(f"the archive holds more than {MAX_TOTAL_BYTES // 2**20} MiB")
        try:
            with self.zf.open(info) as member:
                data = member.read(limit + 1)  # the header's size may lie: read at most this
        except ZIP_ERRORS as exc:
            raise ValueError(f"cannot be read from the zip ({type(exc).__name__}: {exc})") from None
        if len(data) > limit:
            raise ValueError(f"larger than {limit // 2**20} MiB")
        self.total += len(data)
        return data

    def png(self, path: str) -> tuple[bytes, int, int] | str:
        """(png, width, height) or the reason it is not a usable PNG; each path read once."""
        if path not in self.pngs:
            self.pngs[path] = self._load_png(path)
        return self.pngs[path]

    def _load_png(self, path: str) -> tuple[bytes, int, int] | str:
        try:
            png = self.read(path, limit=MAX_MEMBER_BYTES)
        except ValueError as exc:
            return str(exc)
        try:
            with Image.open(io.BytesIO(png)) as img:
                if img.format != "PNG":
                    return f"not a readable PNG (is {img.format}, not PNG)"
                width, height = img.size  # from the header, before any decoding
                if width * height > MAX_PNG_PIXELS:
                    return f"{width}x{height} is more than {MAX_PNG_PIXELS} pixels"
                img.verify()
        except Exception as exc:
            return f"not a readable PNG ({exc})"
        return png, width, height


def archive_read(*, fileobj: IO[bytes], known_tasks: set[str]) -> list[ArchiveTrajectory]:
    """Parse and validate an upload; raise InvalidUpload listing every problem found."""
    try:
        zf = zipfile.ZipFile(fileobj)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise InvalidUpload([f"upload: not a readable .zip archive ({exc})"]) from None
    with zf:
        members = _Members(zf)
        if MANIFEST not in members.names:
            raise InvalidUpload([f"upload: no {MANIFEST} at the top of the archive"])
        try:
            raw = members.read(MANIFEST, limit=MAX_MANIFEST_BYTES)
        except ValueError as exc:
            raise InvalidUpload([f"{MANIFEST}: {exc}"]) from None
        try:
            manifest = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidUpload([f"{MANIFEST}: not valid JSON ({exc})"]) from None
        if not isinstance(manifest, list) or not manifest:
            raise InvalidUpload([f"{MANIFEST}: must be a non-empty list of trajectories"])
        if len(manifest) > MAX_TRAJECTORIES:
            raise InvalidUpload([f"{MANIFEST}: at most {MAX_TRAJECTORIES} trajectories"])
        steps = sum(len(t["steps"]) for t in manifest if isinstance(t, dict)
                    and isinstance(t.get("steps"), list))  # fmt: skip
        if steps > MAX_STEPS:
            raise InvalidUpload([f"{MANIFEST}: {steps} steps; at most {MAX_STEPS} in one upload"])
        errors: list[str] = []
        out = []
        for i, item in enumerate(manifest):
            traj = _trajectory(members, item, f"{MANIFEST}: [{i}]", known_tasks, errors)
            if traj is not None:
                out.append(traj)
            if len(errors) >= MAX_ERRORS:
                errors.append("... (more errors not shown)")
                break
        if errors:
            raise InvalidUpload(errors)
        return out


def _trajectory(members, item, where, known_tasks, errors) -> ArchiveTrajectory | None:
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
    steps = [_step(members, s, f"{where}.steps[{j}]", errors) for j, s in enumerate(steps_raw)]
    if len(errors) > n_before:
        return None
    # No new error: every check above passed (and _step returns None only with an error).
    valid = [s for s in steps if s is not None]
    assert isinstance(task, str) and isinstance(reward, int | float) and len(valid) == len(steps)
    return ArchiveTrajectory(task=task, reward=float(reward), instruction=instruction, steps=valid)


def _step(members: _Members, item, where, errors) -> ArchiveStep | None:
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
    elif path not in members.names:
        errors.append(f"{where}.screenshot: {path!r} is not in the archive")
    else:
        loaded = members.png(path)
        if isinstance(loaded, str):
            errors.append(f"{where}.screenshot: {path}: {loaded}")
        else:
            png, width, height = loaded
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
