"""Does the tiny policy look at the screen? First-click success on held-out MiniWoB++ seeds.

    .venv/bin/python bench/grounding.py --episodes 20
    .venv/bin/python bench/grounding.py --policies blind,untrained,shipped,var/pretrain/exp1

For each of the 7 easy click tasks the grounding pretraining uses (`training.pretrain.
PRETRAIN_TASKS`), every policy plays the same `--episodes` held-out seeds (0, 1, ...; the
pretraining data uses seeds >= 100000) in a real chromium, one action per episode (each of
these tasks is solved by one click), scored by the task's own reward function through the
project's episode runner (prompt builder, UI-TARS parser, coordinate mapping).

Policies:
- blind: clicks the task's mean target position (the mean of the oracle's clicks over
  `--blind-seeds` training seeds): what a policy that ignores the screenshot can reach;
- untrained: a freshly built random-weight tiny policy (`make_tiny_policy`);
- shipped: the repository's pretrained policy (policies/tiny-grounded);
- any local checkpoint directory.
Models decode greedily, in process (no server: this measures the model, not the service).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.actions import format_screen_action  # noqa: E402
from core.prompt_counter import PromptCounter  # noqa: E402
from core.protocol import Action, ActionType, TaskSpec  # noqa: E402
from envmanager.grounding_screens import PRETRAIN_TASKS, TRAIN_SEED_BASE  # noqa: E402
from rollout.client import Completion  # noqa: E402
from rollout.episode import EpisodeConfig, ListRecorder, Outcome, play_episode  # noqa: E402

SHIPPED = ROOT / "policies" / "tiny-grounded"


class BlindEndpoint:
    """Clicks a fixed screen point per task, whatever the screenshot shows."""

    def __init__(self, targets: dict[str, tuple[float, float]], screen: tuple[int, int]):
        self.targets = targets
        self.screen = screen
        self.task = ""
        self.counter = PromptCounter.from_policy_dir(SHIPPED)  # writes as the policy would
        self.geometry = self.counter.geometry

    def complete(self, messages: list[dict[str, Any]], **_: Any) -> Completion:
        started = time.perf_counter()
        x, y = self.targets[self.task]
        click = Action(type=ActionType.CLICK, x=round(x), y=round(y))
        text = format_screen_action(click, screen_size=self.screen, geometry=self.geometry)
        return Completion.scripted(text, started=started, served_by="bench")


class ModelEndpoint:
    """Greedy decoding of a local checkpoint, in this process."""

    def __init__(self, path: Path, max_new_tokens: int = 40):
        from core.policy import load_policy

        self.policy = load_policy(path)
        self.max_new_tokens = max_new_tokens
        self.counter = PromptCounter.from_policy_dir(path)
        self.geometry = self.counter.geometry

    def complete(self, messages: list[dict[str, Any]], **_: Any) -> Completion:
        from core.generation import generate

        started = time.perf_counter()
        out = generate(self.policy, [messages], max_new_tokens=self.max_new_tokens, greedy=True)
        return Completion.scripted(out[0].text, started=started, served_by="bench")


def blind_targets(*, seeds: int) -> dict[str, tuple[float, float]]:
    """Each task's mean oracle click over `seeds` training seeds (never the bench's seeds)."""
    from envmanager.grounding_screens import collect_miniwob_samples

    samples, _ = collect_miniwob_samples(per_task=seeds, seed_base=TRAIN_SEED_BASE)
    out = {}
    for task in PRETRAIN_TASKS:
        points = [(s.x, s.y) for s in samples if s.source == f"miniwob/{task}"]
        out[task] = (statistics.fmean(p[0] for p in points), statistics.fmean(p[1] for p in points))
    return out


def play(env, endpoint, *, task: str, seed: int) -> dict:
    recorder = ListRecorder()
    if isinstance(endpoint, BlindEndpoint):
        endpoint.task = task
    config = EpisodeConfig(
        step_cap=1, max_images=1, max_new_tokens=40, prompt_counter=endpoint.counter
    )
    spec = TaskSpec(
        name=f"miniwob/{task}", env_kind="miniwob", env_config={"task": task}, seed=seed
    )
    result = play_episode(env=env, policy=endpoint, recorder=recorder, task=spec, config=config)
    parsed = bool(recorder.steps) and not recorder.steps[0].parse_error
    return {"success": result.status == Outcome.SUCCEEDED, "parsed": parsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=20, help="held-out seeds per task")
    parser.add_argument("--blind-seeds", type=int, default=30)
    parser.add_argument("--policies", default="blind,untrained,shipped")
    parser.add_argument("--tasks", default=",".join(PRETRAIN_TASKS))
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "grounding.json")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from envmanager.miniwob_env import MiniWoBEnv

    tasks = args.tasks.split(",")
    seeds = list(range(args.episodes))
    names = args.policies.split(",")
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = MiniWoBEnv()
        try:
            for name in names:
                started = time.perf_counter()
                if name == "blind":
                    endpoint: Any = BlindEndpoint(
                        blind_targets(seeds=args.blind_seeds), screen=(160, 210)
                    )
                elif name == "untrained":
                    from training.tiny_policy import build_tiny_policy

                    endpoint = ModelEndpoint(build_tiny_policy(Path(tmp) / "untrained"))
                else:
                    path = SHIPPED if name == "shipped" else Path(name)
                    if not (path / "config.json").exists():
                        print(f"skipping {name}: no checkpoint at {path}", file=sys.stderr)
                        continue
                    endpoint = ModelEndpoint(path)
                per_task = {}
                for task in tasks:
                    outcomes = [play(env, endpoint, task=task, seed=s) for s in seeds]
                    per_task[task] = {
                        "success": sum(o["success"] for o in outcomes) / len(outcomes),
                        "parse_rate": sum(o["parsed"] for o in outcomes) / len(outcomes),
                    }
                results[name] = per_task
                print(f"{name}: {time.perf_counter() - started:.0f}s", file=sys.stderr)
        finally:
            env.close()
    print_table(results, tasks=tasks, seeds=seeds)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"seeds": seeds, "results": results}, indent=2) + "\n")


def print_table(results: dict[str, dict[str, dict]], *, tasks: list[str], seeds: list[int]) -> None:
    names = list(results)
    print(f"\nfirst-click success on seeds {seeds[0]}..{seeds[-1]} ({len(seeds)} per task)")
    print("| task | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for task in tasks:
        cells = [f"{results[n][task]['success']:.0%}" for n in names]
        print(f"| {task} | " + " | ".join(cells) + " |")
    means = [statistics.fmean(results[n][t]["success"] for t in tasks) for n in names]
    print("| **mean** | " + " | ".join(f"**{m:.1%}**" for m in means) + " |")
    parse = [statistics.fmean(results[n][t]["parse_rate"] for t in tasks) for n in names]
    print("| parse rate | " + " | ".join(f"{p:.0%}" for p in parse) + " |")


if __name__ == "__main__":
    main()
