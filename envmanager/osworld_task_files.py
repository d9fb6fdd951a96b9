"""The files an OSWorld task's setup steps read from the host, confined to the task's own
directory.

Four of OSWorld's setup steps read a file on the machine that runs them (the env worker):
`upload_file` (each `files[].local_path`, sent into the VM), `login` and `googledrive` (a
`settings_file`; googledrive's default is a path relative to the working directory) and
`replay` (a `trajectory`). Run as written, a task could send any file of the worker's host,
a key or the service token, into the VM, where the policy reads it.

So at import each such path must be relative, without `..`, and name a regular file (at
most 16 MiB) inside the directory of the task's JSON file (`manage.py import_tasks DIR`);
the file's bytes are stored with the task (`env_config["files"]`, base64 by path). At reset
the env worker writes them into the env's private cache directory and points the steps
there (`steps_with_task_files`): no setup step ever opens a host path. A task uploaded
without its directory, or a stored task naming a file it does not carry, is refused with
the step and the path named.
"""

from __future__ import annotations

import base64
import copy
import os
from pathlib import Path, PurePosixPath
from typing import Any

MAX_FILE_BYTES = 16 * 1024 * 1024
GOOGLEDRIVE_DEFAULT = "evaluation_examples/settings/googledrive/settings.yml"  # OSWorld's


ACCOUNT_STEPS = ("login", "googledrive")  # their file is a Google account's settings


def host_file_refs(steps: Any, field: str, *, accounts: bool = True) -> list[tuple[str, str]]:
    """(field path, file path) of every host file the steps read; `accounts` False leaves
    out the account settings files of ACCOUNT_STEPS."""
    refs: list[tuple[str, str]] = []
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        if not isinstance(step, dict) or not isinstance(step.get("parameters", {}), dict):
            continue
        where, parameters = f"{field}[{i}].parameters", step.get("parameters", {})
        kind = step.get("type")
        if kind == "upload_file":
            files = parameters.get("files")
            for j, item in enumerate(files if isinstance(files, list) else []):
                if isinstance(item, dict):
                    refs.append((f"{where}.files[{j}].local_path", str(item.get("local_path"))))
        elif kind in ACCOUNT_STEPS and accounts:
            default = GOOGLEDRIVE_DEFAULT if kind == "googledrive" else None
            refs.append((f"{where}.settings_file", str(parameters.get("settings_file", default))))
        elif kind == "replay":
            refs.append((f"{where}.trajectory", str(parameters.get("trajectory"))))
    return refs


def path_shape_problem(path: str) -> str | None:
    """Why `path` cannot name a file of a task's directory (None: it can)."""
    parts = PurePosixPath(path).parts
    if not path or path == "None" or PurePosixPath(path).is_absolute() or ".." in parts:
        return (
            f"reads {path!r} from the host: a setup step may read only a file in its task's "
            "own directory, named by a relative path without '..'"
        )
    return None


def task_file_problem(path: str, base: Path | None) -> str | None:
    """Why a setup step may not read `path` (None: it may, from `base`)."""
    if why := path_shape_problem(path):
        return why
    if base is None:
        return (
            f"reads the task's file {path!r}: import the task from its directory "
            "(`manage.py import_tasks DIR`), which holds the file"
        )
    root = base.resolve()
    full = (root / path).resolve()
    if not full.is_relative_to(root):
        return f"reads {path!r}, which leads out of the task's directory {base}"
    if not full.is_file():
        return f"reads {path!r}, which is not a file in the task's directory {base}"
    if full.stat().st_size > MAX_FILE_BYTES:
        return f"reads {path!r}, larger than {MAX_FILE_BYTES // 2**20} MiB"
    return None


def spec_file_refs(
    spec: dict[str, Any], *, postconfig: str = "postconfig", accounts: bool = True
) -> list[tuple[str, str]]:
    """`host_file_refs` of a task object's setup steps and its evaluator's postconfig steps
    (named `postconfig` in the field paths)."""
    evaluator: dict[str, Any] = spec["evaluator"] if isinstance(spec.get("evaluator"), dict) else {}
    return [
        *host_file_refs(spec.get("config"), "config", accounts=accounts),
        *host_file_refs(evaluator.get("postconfig"), postconfig, accounts=accounts),
    ]


def task_files(spec: dict[str, Any], base: Path) -> dict[str, str]:
    """The bytes (base64) of every file the task's steps read, by path (checked first; an
    account's settings file only where the task's directory has it)."""
    plain = {path for _, path in spec_file_refs(spec, accounts=False)}
    return {
        path: base64.b64encode((base.resolve() / path).read_bytes()).decode()
        for _, path in spec_file_refs(spec)
        if path in plain or task_file_problem(path, base) is None
    }


def steps_with_task_files(
    steps: list[dict[str, Any]], files: dict[str, str], into: Path, *, field: str = "config"
) -> list[dict[str, Any]]:
    """`steps` reading the task's stored files from `into` (written there, 0600), never from
    a host path. ValueError names a step whose file the task does not carry."""
    out = copy.deepcopy(steps)
    for where, path in host_file_refs(out, field):
        if path not in files:
            raise ValueError(
                f"setup step {where} reads {path!r}, which the task does not carry "
                "(import it again from its directory)"
            )
    written: dict[str, str] = {}
    for path, data in files.items():
        target = into / PurePosixPath(path)
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(base64.b64decode(data))
        written[path] = str(target)
    for step in out:
        parameters = step.get("parameters") if isinstance(step, dict) else None
        if not isinstance(parameters, dict):
            continue
        if step.get("type") == "upload_file":
            for item in parameters.get("files") or []:
                item["local_path"] = written[str(item.get("local_path"))]
        elif step.get("type") in ("login", "googledrive"):
            default = GOOGLEDRIVE_DEFAULT if step["type"] == "googledrive" else None
            parameters["settings_file"] = written[str(parameters.get("settings_file", default))]
        elif step.get("type") == "replay":
            parameters["trajectory"] = written[str(parameters.get("trajectory"))]
    return out
