"""The MiniWoB++ task catalogue: every task the `miniwob` package ships, its split and tags.

Split rule (deterministic, documented so a database can be rebuilt identically):
a task is "eval" when the first 8 hex digits of sha256("miniwob/" + name), read as an
integer, modulo 100 are below 20 (about 20% of tasks), else "train"; the easy tasks in
`STARTER_TASKS` are always "train" so a fresh run has solvable tasks to learn from.

    .venv/bin/python -c "from envmanager.miniwob_tasks import miniwob_task_records as r; print(len(r()))"
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

EVAL_PERCENT = 20
# The seven single-click starter tasks, in this order: always "train", the shipped tiny
# policy's grounding pretraining set (its cache key joins them in this order) and the
# benchmarks' task list. One list: everything else imports it.
STARTER_TASKS = (
    "click-test",
    "click-test-2",
    "click-button",
    "click-link",
    "focus-text",
    "click-dialog",
    "click-color",
)
ALWAYS_TRAIN = frozenset(STARTER_TASKS)
# Single-action or very short tasks (a random clicker sometimes solves them).
EASY = ALWAYS_TRAIN | {
    "focus-text-2",
    "click-dialog-2",
    "click-tab",
    "click-widget",
    "click-option",
}


def miniwob_task_names() -> list[str]:
    """Sorted subdomains of every task the package registers (its gym env classes)."""
    from miniwob.envs import miniwob_envs

    subdomains = (
        getattr(cls, "subdomain", None)
        for _, cls in inspect.getmembers(miniwob_envs, inspect.isclass)
    )
    names = {s for s in subdomains if isinstance(s, str)}
    return sorted(names)


def miniwob_split(*, name: str) -> str:
    """ "train" or "eval" for a subdomain (see the module docstring for the rule)."""
    if name in ALWAYS_TRAIN:
        return "train"
    digest = hashlib.sha256(f"miniwob/{name}".encode()).hexdigest()
    return "eval" if int(digest[:8], 16) % 100 < EVAL_PERCENT else "train"


def miniwob_tags(*, name: str) -> list[str]:
    """Coarse skill tags from the task name, plus "easy" for `EASY` tasks."""
    rules = [
        ("click", ("click", "focus", "navigate", "tic-tac-toe", "simon", "hover")),
        ("type", ("enter", "login", "text", "email", "search", "terminal", "copy-paste")),
        ("drag", ("drag", "draw", "slider", "resize", "colorwheel", "bisect")),
        ("form", ("form", "book-flight", "choose", "buy", "order", "checkbox", "option")),
        ("scroll", ("scroll",)),
        ("reasoning", ("arithmetic", "algebra", "count", "find", "guess", "odd", "visual")),
    ]
    tags = [tag for tag, words in rules if any(word in name for word in words)]
    if name in EASY:
        tags.append("easy")
    return tags or ["other"]


EPISODE_SECONDS = 60


def miniwob_task_records() -> list[dict[str, Any]]:
    """Import records for every task: name, env_kind, env_config, instruction, split, tags.

    instruction is empty: MiniWoB generates a new utterance at each reset.
    """
    return [
        {
            "name": f"miniwob/{name}",
            "env_kind": "miniwob",
            # MiniWoB's own 10 s limit (and its time-decayed reward) assumes a fast agent;
            # a CPU policy needs more time per step.
            "env_config": {"task": name, "episode_seconds": EPISODE_SECONDS},
            "instruction": "",
            "split": miniwob_split(name=name),
            "tags": miniwob_tags(name=name),
        }
        for name in miniwob_task_names()
    ]
