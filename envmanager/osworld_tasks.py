"""OSWorld's task JSON (evaluation_examples/examples/<app>/<id>.json), checked before import.

A task file holds one object:

    {"id": "...", "instruction": "...",
     "config": [{"type": "launch", "parameters": {...}}, ...],     # SetupController steps
     "evaluator": {"func": "exact_match" | [...] | "infeasible",
                   "result": {"type": "vm_command_line", ...} | [...],   # getters
                   "expected": {"type": "rule", ...} | [...],            # optional
                   "options": {...} | [...], "conj": "and" | "or",       # optional
                   "postconfig": [...]},                                 # optional
     "related_apps": ["chrome"], "snapshot": "...", "source": "...", ...}

`osworld_task_problems(data)` lists what Dartboard cannot run on any slot, each as (field,
reason): a setup step type the wheel's SetupController has no `_<type>_setup` for, a metric
func or a getter type the wheel does not export (with the closest names), a metric or
getter the review refuses because it would run the agent's content on the host or cannot
score (named with why: envmanager.osworld_metric_review), a cache file name that is a path
(a getter's `dest`, an execute step's `stdout`), a host file a setup step reads outside the
task's directory, a missing or mistyped field. What the task needs of its slot is not a
problem here (envmanager.osworld_needs). Keys Dartboard does not read (snapshot, source,
trajectory, proxy, ...) are kept as they are: the whole object is stored in the task's env_config.

    .venv/bin/python -c "import json,sys; from envmanager.osworld_tasks import osworld_task_problems as p; \
        print(p(json.load(open(sys.argv[1]))))" tasks/osworld/dartboard-terminal-mkdir.json
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from envmanager.osworld_metric_review import getter_review_refusal
from envmanager.osworld_task_files import path_shape_problem, spec_file_refs, task_file_problem
from envmanager.osworld_wheel import INFEASIBLE, getter_refusal, setup_step_refusal, wheel

Problem = tuple[str, str]  # (field path, reason)
POSTCONFIG = "evaluator.postconfig"


def is_osworld_task(data: Any) -> bool:
    """Whether a decoded JSON object is in OSWorld's task format (not Dartboard's record)."""
    return isinstance(data, dict) and "evaluator" in data and "env_kind" not in data


def _steps(steps: Any, field: str, setup_types: frozenset[str]) -> list[Problem]:
    if not isinstance(steps, list):
        return [(field, "must be a list of setup steps")]
    problems = []
    for i, step in enumerate(steps):
        where = f"{field}[{i}]"
        if not isinstance(step, dict) or not isinstance(step.get("type"), str):
            problems.append((where, "a setup step is an object with a 'type'"))
            continue
        if step["type"] not in setup_types:
            problems.append(
                (
                    f"{where}.type",
                    f"unknown setup step type {step['type']!r} (OSWorld's "
                    f"SetupController has: {', '.join(sorted(setup_types))})",
                )
            )
        parameters = step.get("parameters", {})
        if not isinstance(parameters, dict):
            problems.append((f"{where}.parameters", "must be an object"))
        elif step["type"] in ("execute", "command") and (why := setup_step_refusal(parameters)):
            problems.append((f"{where}.parameters", why))
    return problems


def closest(name: str, known: Any) -> str:
    """' (closest: a, b)' naming the known names nearest `name`, or '' when none is near."""
    near = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
    return f" (closest: {', '.join(near)})" if near else ""


def _getter(config: Any, field: str, getters: dict[str, Any]) -> list[Problem]:
    if config is None or config == {}:
        return []
    if not isinstance(config, dict) or not isinstance(config.get("type"), str):
        return [(field, "a getter is an object with a 'type'")]
    if config["type"] not in getters:
        return [
            (
                f"{field}.type",
                f"the wheel has no getter {config['type']!r}" + closest(config["type"], getters),
            )
        ]
    why = getter_review_refusal(config["type"]) or getter_refusal(config)
    return [(field, why)] if why else []


def osworld_task_problems(
    data: dict[str, Any], *, base_dir: Path | None = None, files: dict[str, Any] | None = None
) -> list[Problem]:
    """Everything in an OSWorld task object that Dartboard cannot run (empty: importable).
    `base_dir`: the directory of the task's JSON file, the only place its setup steps may
    read files from (`envmanager.osworld_task_files`); `files`: the files a stored task
    carries instead (a Dartboard record's env_config.files)."""
    w = wheel()
    problems: list[Problem] = []
    plain = {field for field, _ in spec_file_refs(data, postconfig=POSTCONFIG, accounts=False)}
    for field, path in spec_file_refs(data, postconfig=POSTCONFIG):
        if files is not None and path in files:
            continue
        if field not in plain:  # an account's settings: the task needs google_drive
            why = path_shape_problem(path)
        else:
            why = task_file_problem(path, base_dir)
        if why:
            problems.append((field, why))
    if not isinstance(data.get("id"), str) or not data["id"].strip():
        problems.append(("id", "must be a non-empty string"))
    if not isinstance(data.get("instruction"), str) or not data["instruction"].strip():
        problems.append(("instruction", "must be a non-empty string"))
    problems += _steps(data.get("config", []), "config", w.setup_types)
    apps = data.get("related_apps", [])
    if not isinstance(apps, list) or not all(isinstance(a, str) for a in apps):
        problems.append(("related_apps", "must be a list of strings"))
    evaluator = data.get("evaluator")
    if not isinstance(evaluator, dict):
        return [*problems, ("evaluator", "must be an object with a 'func'")]
    problems += _steps(evaluator.get("postconfig", []), "evaluator.postconfig", w.setup_types)
    func = evaluator.get("func")
    if func == INFEASIBLE:
        return problems
    funcs = func if isinstance(func, list) else [func]
    if not funcs or not all(isinstance(f, str) for f in funcs):
        return [*problems, ("evaluator.func", "must be a metric name or a list of them")]
    for i, name in enumerate(funcs):
        where = "evaluator.func" if not isinstance(func, list) else f"evaluator.func[{i}]"
        if name in w.refused_metrics:
            problems.append((where, f"metric {name!r} is refused: {w.refused_metrics[name]}"))
        elif name not in w.metrics:
            known = [*w.metrics, *w.refused_metrics]
            problems.append((where, f"the wheel has no metric {name!r}" + closest(name, known)))
    if evaluator.get("conj", "and") not in ("and", "or"):
        problems.append(("evaluator.conj", "must be 'and' or 'or'"))
    for key in ("result", "expected", "options"):
        value = evaluator.get(key)
        if isinstance(func, list) and value is not None and not isinstance(value, list):
            problems.append((f"evaluator.{key}", f"func is a list: {key} must be a list too"))
        elif isinstance(func, list) and isinstance(value, list) and len(value) != len(funcs):
            problems.append(
                (f"evaluator.{key}", f"has {len(value)} entries for {len(funcs)} funcs")
            )
    if "result" not in evaluator:
        problems.append(("evaluator.result", "is required (a getter)"))
    for key in ("result", "expected"):
        value = evaluator.get(key)
        items = value if isinstance(func, list) and isinstance(value, list) else [value]
        for i, item in enumerate(items):
            where = (
                f"evaluator.{key}"
                if len(items) == 1 and not isinstance(value, list)
                else (f"evaluator.{key}[{i}]")
            )
            problems += _getter(item, where, w.getters)
    return problems
