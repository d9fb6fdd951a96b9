"""Can a policy do the desktop tasks before any RL? Greedy success per X desktop task.

    .venv/bin/python bench/desktop.py [--episodes 5] [--policies blind,shipped,desktop]

Each policy plays `--episodes` episodes of every training desktop task (`make run-desktop`'s
7) on a real X desktop (envmanager.desktop_env: Xvfb, openbox, the sandboxed apps), through
the project's episode runner with the desktop preset's rollout settings (its step cap, its
screenshots of context, one unparsable output ends the episode), scored by the task's own
checker. Greedy decoding is deterministic, but the screens are not quite (a caret blinks,
windows draw late), so episodes can differ; the table gives each task's successes with the
95% Wilson interval, and the mean over tasks.

Policies:
- blind: clicks the task's target position (its oracle's first point; one fixed instance per
  task, so the mean target is that point) and then says it is done, whatever the screen
  shows: what one left click at the right place reaches;
- shipped: policies/tiny-grounded (pretrained on MiniWoB++ screens only);
- desktop: policies/tiny-desktop (`make policy-desktop`: also pretrained on synthetic desktops);
- any local checkpoint directory.
Models decode in process (no server: this measures the model, not the service). Writes
bench/results/desktop.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.grounding import ModelEndpoint  # noqa: E402
from core.actions import format_screen_action  # noqa: E402
from core.prompt_counter import PromptCounter  # noqa: E402
from core.protocol import Action, ActionType, TaskSpec  # noqa: E402
from rollout.client import Completion  # noqa: E402
from rollout.episode import EpisodeConfig, ListRecorder, Outcome, play_episode  # noqa: E402

POLICIES = {
    "shipped": ROOT / "policies" / "tiny-grounded",
    "desktop": ROOT / "policies" / "tiny-desktop",
}


class BlindEndpoint:
    """A left click at the task's target, then finished, whatever the screenshots show."""

    def __init__(self, counter: PromptCounter, screen: tuple[int, int]):
        self.counter = counter
        self.geometry = counter.geometry
        self.screen = screen
        self.target = (0, 0)

    def complete(self, messages: list[dict[str, Any]], **_: Any) -> Completion:
        started = time.perf_counter()
        turn = sum(1 for m in messages if m["role"] == "assistant")
        if turn == 0:
            action = Action(type=ActionType.CLICK, x=self.target[0], y=self.target[1])
        else:
            action = Action(type=ActionType.FINISHED, text="done")
        text = format_screen_action(action, screen_size=self.screen, geometry=self.geometry)
        return Completion.scripted(text, started=started, served_by="bench")


def task_target(name: str) -> tuple[int, int]:
    """The first point of the task's oracle plan (its target; the centre for tasks without)."""
    from envmanager.desktop_tasks import desktop_oracle_plan

    for action in desktop_oracle_plan(name=name):
        if action.x is not None and action.y is not None:
            return action.x, action.y
    return 400, 300


def preset_episode_config(counter: PromptCounter) -> EpisodeConfig:
    """`make run-desktop`'s rollout settings, greedy (as the run's evaluations decode)."""
    from datamanager.config import CurationConfig
    from hostagent.main_job import DESKTOP_ROLLOUT

    return EpisodeConfig(
        step_cap=CurationConfig().default_step_cap,  # a task's cap before its first success
        max_images=DESKTOP_ROLLOUT["max_images"],
        max_new_tokens=DESKTOP_ROLLOUT["max_new_tokens"],
        max_parse_errors=DESKTOP_ROLLOUT["max_parse_errors"],
        temperature=0.0,
        prompt_counter=counter,
    )


def play(env, endpoint, *, task: str, config: EpisodeConfig) -> dict:
    from envmanager.desktop_tasks import desktop_task

    spec = TaskSpec(
        name=task,
        env_kind="desktop",
        env_config={"task": task},
        instruction=desktop_task(name=task).instruction,
    )
    recorder = ListRecorder()
    result = play_episode(env=env, policy=endpoint, recorder=recorder, task=spec, config=config)
    actions = [
        (s.action or {}).get("type", "unparsable") if not s.parse_error else "unparsable"
        for s in recorder.steps
    ]
    return {"success": result.status == Outcome.SUCCEEDED, "actions": actions}


def main() -> None:
    import os

    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
    django.setup()  # the preset's settings live in the Django app (read, no database)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=5, help="episodes per task and policy")
    parser.add_argument("--policies", default="blind,shipped,desktop")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "desktop.json")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(2)
    from datamanager.eval_metrics import wilson_interval
    from envmanager.desktop_env import HEIGHT, WIDTH, DesktopEnv
    from envmanager.desktop_tasks import DESKTOP_TASKS

    tasks = [name for name, t in DESKTOP_TASKS.items() if t.split == "train"]
    results: dict[str, dict[str, dict]] = {}
    env = DesktopEnv()
    try:
        for name in args.policies.split(","):
            started = time.perf_counter()
            if name == "blind":
                counter = PromptCounter.from_policy_dir(POLICIES["shipped"])
                endpoint: Any = BlindEndpoint(counter, screen=(WIDTH, HEIGHT))
            else:
                path = POLICIES.get(name, Path(name))
                if not (path / "config.json").exists():
                    print(f"skipping {name}: no checkpoint at {path}", file=sys.stderr)
                    continue
                endpoint = ModelEndpoint(path, max_new_tokens=48)
            config = preset_episode_config(endpoint.counter)
            per_task = {}
            for task in tasks:
                if isinstance(endpoint, BlindEndpoint):
                    endpoint.target = task_target(task)
                outcomes = [
                    play(env, endpoint, task=task, config=config) for _ in range(args.episodes)
                ]
                ok = sum(o["success"] for o in outcomes)
                low, high = wilson_interval(ok, len(outcomes))
                per_task[task] = {"ok": ok, "n": len(outcomes), "low": low, "high": high,
                                  "actions": outcomes[0]["actions"]}  # fmt: skip
                print(
                    f"{name} {task}: {ok}/{len(outcomes)} {outcomes[0]['actions']}", file=sys.stderr
                )
            results[name] = per_task
            print(f"{name}: {time.perf_counter() - started:.0f}s", file=sys.stderr)
    finally:
        env.close()
    print_table(results, tasks=tasks)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"episodes": args.episodes, "results": results}, indent=2) + "\n"
    )


def print_table(results: dict[str, dict[str, dict]], *, tasks: list[str]) -> None:
    names = list(results)
    print("\ngreedy success per desktop task (successes/episodes, 95% interval)")
    print("| task | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for task in tasks:
        cells = []
        for n in names:
            r = results[n][task]
            cells.append(f"{r['ok']}/{r['n']} [{r['low']:.0%}, {r['high']:.0%}]")
        print(f"| {task} | " + " | ".join(cells) + " |")
    means = [
        statistics.fmean(results[n][t]["ok"] / results[n][t]["n"] for t in tasks) for n in names
    ]
    print("| **mean** | " + " | ".join(f"**{m:.0%}**" for m in means) + " |")
    if "blind" in results:
        for n in names:
            if n == "blind":
                continue
            above = sum(
                results[n][t]["ok"] / results[n][t]["n"]
                > results["blind"][t]["ok"] / results["blind"][t]["n"]
                for t in tasks
            )
            print(f"{n}: above blind on {above} of {len(tasks)} tasks")


if __name__ == "__main__":
    main()
