"""Dartboard's own upload archive: `manifest.json` and the screenshots it names.

    manifest.json = [
      {"task": "miniwob/click-button",    # an existing Task name
       "reward": 1.0,                     # number in [0, 1]
       "instruction": "Click OK",         # optional, the instruction the demo followed
       "steps": [                         # at least one
         {"screenshot": "shots/0.png",    # an image in the archive: the screen the action was chosen on
          "action": {"type": "click", "x": 40, "y": 80},   # core.protocol.Action's JSON, screen pixels
          "thought": "The OK button",     # optional
          "raw_output": "..."}            # optional: the policy's reply; else Dartboard's text of the action
       ]}
    ]

Every problem is reported with the file and the field it is in. A screenshot named by many
steps is checked once.
"""

from __future__ import annotations

import json
from typing import Any

from core.actions import format_action
from core.protocol import Action
from datamanager.demos.episodes import (
    MAX_MANIFEST_BYTES,
    DemoEpisode,
    DemoFileError,
    DemoFiles,
    DemoStep,
    Shot,
    shot_read,
)
from datamanager.demos.osworld import DemoRead

MANIFEST = "manifest.json"
MAX_TRAJECTORIES = 5000
MAX_STEPS = 50_000  # in all trajectories


def manifest_read(files: DemoFiles) -> DemoRead:
    """The trajectories of an archive's manifest, checked; nothing is stored."""
    out = DemoRead()
    names = set(files.names())
    if MANIFEST not in names:
        out.errors.append(f"{files.label}: no {MANIFEST} at the top of the archive")
        return out
    try:
        manifest = json.loads(files.read(MANIFEST, limit=MAX_MANIFEST_BYTES).decode("utf-8"))
    except DemoFileError as exc:
        out.errors.append(f"{MANIFEST}: {exc}")
        return out
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        out.errors.append(f"{MANIFEST}: not valid JSON ({exc})")
        return out
    if not isinstance(manifest, list) or not manifest:
        out.errors.append(f"{MANIFEST}: must be a non-empty list of trajectories")
        return out
    if len(manifest) > MAX_TRAJECTORIES:
        out.errors.append(f"{MANIFEST}: at most {MAX_TRAJECTORIES} trajectories")
        return out
    steps = sum(
        len(t["steps"])
        for t in manifest
        if isinstance(t, dict) and isinstance(t.get("steps"), list)
    )
    if steps > MAX_STEPS:
        out.errors.append(f"{MANIFEST}: {steps} steps; at most {MAX_STEPS} in one upload")
        return out
    shots: dict[str, Shot | str] = {}
    for i, item in enumerate(manifest):
        episode = _trajectory(files, names, shots, item, f"{MANIFEST}: [{i}]", out.errors)
        if episode is not None:
            out.episodes.append(episode)
    return out


def _trajectory(
    files, names, shots, item: Any, where: str, errors: list[str]
) -> DemoEpisode | None:
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
    steps = [
        _step(files, names, shots, s, f"{where}.steps[{j}]", errors)
        for j, s in enumerate(steps_raw)
    ]
    if len(errors) > n_before:
        return None
    # No new error: every check above passed (and _step returns None only with an error).
    valid = [s for s in steps if s is not None]
    assert (
        isinstance(task, str) and isinstance(reward, int | float) and isinstance(instruction, str)
    )
    return DemoEpisode(
        task_key=task, instruction=instruction, reward=float(reward), steps=valid, source=where
    )


def _step(
    files, names: set[str], shots: dict[str, Shot | str], item: Any, where: str, errors: list[str]
) -> DemoStep | None:
    if not isinstance(item, dict):
        errors.append(f"{where}: must be an object")
        return None
    n_before = len(errors)
    unknown = sorted(set(item) - {"screenshot", "action", "thought", "raw_output"})
    if unknown:
        errors.append(f"{where}: unknown field(s) {unknown}")
    path = item.get("screenshot")
    shot: Shot | None = None
    if not isinstance(path, str) or not path:
        errors.append(f"{where}.screenshot: must be a path inside the archive")
    elif path not in names:
        errors.append(f"{where}.screenshot: {path!r} is not in the archive")
    else:
        if path not in shots:
            try:
                shots[path] = shot_read(files, path)
            except DemoFileError as exc:
                shots[path] = str(exc)
        found = shots[path]
        if isinstance(found, str):
            errors.append(f"{where}.screenshot: {path}: {found}")
        else:
            shot = found
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
    if len(errors) > n_before or action is None or shot is None:
        return None
    return DemoStep(
        shot=shot, action=action, thought=thought, source=where, recorded=raw_output or ""
    )
