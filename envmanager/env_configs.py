"""What a task's `env_config` holds, per environment kind: the keys each backend reads, their
types, and what they do. The task importer refuses a key its kind does not read or a value
of the wrong type (datamanager.task_import), and `manage.py docs_reference` writes the
table of docs/reference/env-config.md from ENV_CONFIG_KEYS, so the two cannot disagree.

    env_config_problems("miniwob", {"task": "click-test", "episode_secs": 5})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvConfigKey:
    name: str
    types: tuple[type, ...]
    help: str
    required: bool = False

    @property
    def type_name(self) -> str:
        names = {str: "string", int: "integer", float: "number", dict: "object", list: "list"}
        return " or ".join(dict.fromkeys(names[t] for t in self.types))


# Every kind: the task's own step budget (datamanager.services.episodes), else the run's.
STEP_CAP = EnvConfigKey(
    "max_steps", (int,), "The task's own step budget, instead of the run's default_step_cap."
)
ENV_CONFIG_KEYS: dict[str, tuple[EnvConfigKey, ...]] = {
    "miniwob": (
        EnvConfigKey("task", (str,), "The MiniWoB++ task: its page's name (`click-test`).", True),
        EnvConfigKey(
            "episode_seconds",
            (int, float),
            "The task's own time limit in seconds (MiniWoB++'s default is 10 s).",
        ),
        STEP_CAP,
    ),
    "desktop": (
        EnvConfigKey(
            "task",
            (str,),
            "The desktop task it runs (`envmanager/desktop_tasks.py`: `desktop/double-click`); "
            "default: the task's name.",
        ),
        STEP_CAP,
    ),
    "sim": (
        EnvConfigKey("targets", (int,), "Buttons to click on the simulated screen (default 1)."),
        EnvConfigKey(
            "width", (int,), "The simulated screen's width in pixels (320, the default, to 4096)."
        ),
        EnvConfigKey(
            "height", (int,), "The simulated screen's height in pixels (200, the default, to 4096)."
        ),
        STEP_CAP,
        EnvConfigKey(
            "crash_first", (int,), "Resets that fail before one succeeds (fault drills; 0)."
        ),
    ),
    "osworld": (
        EnvConfigKey(
            "osworld",
            (dict,),
            "OSWorld's task object as OSWorld writes it: `id`, `instruction`, `config` (setup "
            "steps), `evaluator` (`func`, `result`, `expected`, `options`, `conj`, "
            "`postconfig`), `related_apps`.",
            True,
        ),
        EnvConfigKey(
            "files",
            (dict,),
            "The files its setup steps read, base64 by relative path: written by the importer "
            "from the task's directory.",
        ),
        EnvConfigKey(
            "needs",
            (list,),
            "What it needs of its slot (`app:chrome`, `internet`, ...): set by the importer "
            "from the task object (a given value is replaced).",
        ),
        EnvConfigKey(
            "address",
            (str,),
            "The VM (host:port) this task runs on, instead of the run's `osworld_addresses`.",
        ),
        STEP_CAP,
    ),
}


def env_config_problems(kind: str, env_config: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, reason) for each key of `env_config` that kind `kind` does not read or whose
    value has the wrong type, and each required key it lacks."""
    keys = {key.name: key for key in ENV_CONFIG_KEYS.get(kind, ())}
    problems = []
    for name, value in env_config.items():
        key = keys.get(name)
        if key is None:
            known = ", ".join(keys) or "none"
            problems.append((name, f"not read by {kind} tasks (their keys: {known})"))
        elif not isinstance(value, key.types) or isinstance(value, bool):
            problems.append((name, f"must be {key.type_name}, got {type(value).__name__}"))
    for key in keys.values():
        if key.required and key.name not in env_config:
            problems.append((key.name, "is required"))
    return problems
