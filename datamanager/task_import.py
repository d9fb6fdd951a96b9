"""The task file format and its validation (no database access here).

A task file is JSON Lines (one object per line; blank lines and lines starting with '#'
are skipped) or a JSON array of objects. Each object:

    {"name": "miniwob/click-test",          # unique; importing again updates the task
     "env_kind": "miniwob",                  # miniwob | desktop | sim | osworld
     "env_config": {"task": "click-test"},   # backend-specific, an object (optional)
     "instruction": "",                      # optional; empty when the environment sets it
     "split": "train",                       # train | eval (optional, default train)
     "tags": ["click", "easy"]}              # optional list of strings

A malformed record raises `InvalidTaskRecord` naming the line (JSONL) or the record index
(JSON array) and the field.

A file holding one OSWorld task object (`evaluation_examples/examples/<app>/<id>.json`:
`id`, `instruction`, `config`, `evaluator`, `related_apps`, ...; see envmanager/osworld_tasks.py)
becomes one task named `osworld/<id>` of env_kind `osworld`, the whole object kept as
env_config {"osworld": {...}, "needs": [...]}, tagged `osworld` and its related apps, in the
split the caller gives (train by default). "needs" is what it asks of the slot it runs on
(envmanager.osworld_needs: an application, Chrome's debugging port, an accessibility tree,
the internet, ...): a task imports whatever its needs, and a run places it only where they
are offered. What no slot can give is refused, listed with the file and field, and the file
imports nothing: a setup step type, a metric func or a getter type the wheel lacks (with
the closest names), a metric or getter refused by the review because it would run the
agent's content on the host or cannot score (named with why), a cache file name that is a
path.
`read_task_path` reads a directory as all its *.json files (OSWorld's layout), and lists
every bad file, not only the first.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datamanager.models import EnvKind, Split
from envmanager.env_configs import env_config_problems
from envmanager.osworld_needs import task_needs
from envmanager.osworld_task_files import task_files
from envmanager.osworld_tasks import is_osworld_task, osworld_task_problems

ENV_KINDS = tuple(EnvKind.values)
SPLITS = tuple(Split.values)
FIELDS = {"name", "env_kind", "env_config", "instruction", "split", "tags"}


class InvalidTaskRecord(ValueError):
    """A task record is malformed; the message names where and why."""


@dataclass(frozen=True)
class TaskRecord:
    name: str
    env_kind: str
    env_config: dict[str, Any] = field(default_factory=dict)
    instruction: str = ""
    split: str = "train"
    tags: tuple[str, ...] = ()


def parse_task_record(data: Any, where: str) -> TaskRecord:
    """Validate one decoded record. `where` is e.g. 'tasks.jsonl line 3'."""
    if not isinstance(data, dict):
        raise InvalidTaskRecord(f"{where}: a task must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise InvalidTaskRecord(
            f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(FIELDS))})"
        )
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InvalidTaskRecord(f"{where}: field 'name' must be a non-empty string")
    if len(name) > 200:
        raise InvalidTaskRecord(f"{where}: field 'name' is longer than 200 characters")
    env_kind = data.get("env_kind")
    if env_kind not in ENV_KINDS:
        raise InvalidTaskRecord(
            f"{where}: field 'env_kind' must be one of {', '.join(ENV_KINDS)}, got {env_kind!r}"
        )
    env_config = data.get("env_config", {})
    if not isinstance(env_config, dict):
        raise InvalidTaskRecord(f"{where}: field 'env_config' must be an object")
    if env_kind == "osworld":
        spec = env_config.get("osworld")
        if not isinstance(spec, dict):
            raise InvalidTaskRecord(f"{where}: field 'env_config.osworld' must be an OSWorld task")
        files = env_config.get("files", {})
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in files.items()
        ):
            raise InvalidTaskRecord(
                f"{where}: field 'env_config.files' must map file paths to base64 contents"
            )
        _check_osworld(spec, f"{where}: env_config.osworld.", files=files)
        env_config = {**env_config, "needs": task_needs(spec)}
    instruction = data.get("instruction", "")
    if not isinstance(instruction, str):
        raise InvalidTaskRecord(f"{where}: field 'instruction' must be a string")
    split = data.get("split", "train")
    if split not in SPLITS:
        raise InvalidTaskRecord(
            f"{where}: field 'split' must be {' or '.join(SPLITS)}, got {split!r}"
        )
    tags = data.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
        raise InvalidTaskRecord(f"{where}: field 'tags' must be a list of non-empty strings")
    if wrong := env_config_problems(env_kind, env_config):
        key, reason = wrong[0]
        raise InvalidTaskRecord(f"{where}: field 'env_config.{key}' {reason}")
    return TaskRecord(
        name=name.strip(),
        env_kind=env_kind,
        env_config=env_config,
        instruction=instruction,
        split=split,
        tags=tuple(tags),
    )


def _check_osworld(
    spec: dict[str, Any], where: str, *, base_dir: Path | None = None, files: dict | None = None
) -> None:
    problems = osworld_task_problems(spec, base_dir=base_dir, files=files)
    if problems:
        raise InvalidTaskRecord(
            "; ".join(f"{where}{field}: {reason}" for field, reason in problems)
        )


def osworld_record(
    spec: dict[str, Any], where: str, base_dir: Path | None = None, *, split: str = "train"
) -> TaskRecord:
    """The task record of one OSWorld task object (checked first), carrying the files its
    setup steps read from `base_dir`, its JSON file's directory, and what it needs."""
    _check_osworld(spec, f"{where}: ", base_dir=base_dir)
    apps = [a for a in spec.get("related_apps", []) if a]
    files = task_files(spec, base_dir) if base_dir is not None else {}
    return TaskRecord(
        name=osworld_task_name(spec["id"]),
        env_kind=EnvKind.OSWORLD,
        env_config={
            "osworld": spec,
            "needs": task_needs(spec),
            **({"files": files} if files else {}),
        },
        instruction=spec["instruction"],
        split=split,
        tags=("osworld", *dict.fromkeys(apps)),
    )


def osworld_task_name(task_id: str) -> str:
    """The Dartboard task name of OSWorld task `task_id`."""
    return f"osworld/{task_id.strip()}"[:200]


def read_task_path(path: Path, *, split: str | None = None) -> list[TaskRecord]:
    """A task file, or every *.json file of a directory (OSWorld's examples layout).
    `split`: put every task in this split (OSWorld's files name none). A directory's bad
    files are all listed in one InvalidTaskRecord, one line each."""
    if split is not None and split not in SPLITS:
        raise InvalidTaskRecord(f"split must be {' or '.join(SPLITS)}, got {split!r}")
    if not path.is_dir():
        return read_task_file(path, split=split)
    files = sorted(path.rglob("*.json"))
    if not files:
        raise InvalidTaskRecord(f"{path}: no *.json task files in this directory")
    records: list[TaskRecord] = []
    bad: list[str] = []
    for file in files:
        try:
            records += read_task_file(file, split=split)
        except InvalidTaskRecord as exc:
            bad.append(str(exc))
    names = [r.name for r in records]
    twice = sorted({n for n in names if names.count(n) > 1})
    bad += [f"{path}: task {name!r} appears twice" for name in twice]
    if bad:
        raise InvalidTaskRecord(
            f"{len(bad)} of {len(files)} files in {path} cannot be imported:\n" + "\n".join(bad)
        )
    return records


def read_task_file(path: Path, *, split: str | None = None) -> list[TaskRecord]:
    """Read and validate a whole file; raise on the first bad record (nothing is returned).
    `split`: put every task in this split instead of the one its record names."""
    records = _read_task_file(path)
    if split is not None:
        records = [dataclasses.replace(rec, split=split) for rec in records]
    return records


def _read_task_file(path: Path) -> list[TaskRecord]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidTaskRecord(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise InvalidTaskRecord(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    records: list[TaskRecord] = []
    if text.lstrip().startswith("{") and "\n{" not in text.strip():
        try:
            item = json.loads(text)
        except json.JSONDecodeError:
            item = None  # a one-line JSON Lines file, read below
        if is_osworld_task(item):
            return [osworld_record(item, str(path), path.parent)]
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidTaskRecord(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        for i, item in enumerate(items):
            where = f"{path} record {i + 1}"
            records.append(
                osworld_record(item, where, path.parent)
                if is_osworld_task(item)
                else parse_task_record(item, where)
            )
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            try:
                item = json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise InvalidTaskRecord(f"{path} line {lineno}: invalid JSON ({exc.msg})") from None
            records.append(parse_task_record(item, f"{path} line {lineno}"))
    seen: set[str] = set()
    for rec in records:
        if rec.name in seen:
            raise InvalidTaskRecord(f"{path}: task {rec.name!r} appears twice")
        seen.add(rec.name)
    return records
