"""Grounding screens from real environments: the first oracle click of MiniWoB++ episodes,
with the clicked element's box, for the tiny policy's grounding pretraining
(`training.pretrain` trains on them; `manage.py pretrain_policy` collects them).

    .venv/bin/python -m envmanager.grounding_screens var/pretrain/miniwob.pkl 500
"""

from __future__ import annotations

import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from core.protocol import ActionType, TaskSpec
from core.samples import GroundingSample
from envmanager.miniwob_env import MiniWoBEnv
from envmanager.miniwob_tasks import STARTER_TASKS
from envmanager.oracles import oracle_action

PRETRAIN_TASKS = STARTER_TASKS
TRAIN_SEED_BASE = 100_000  # training seeds start here; bench seeds stay below


@dataclass(frozen=True)
class DemoStats:
    collected: int
    skipped: int
    seconds: float


def _target_box(
    elements: list[dict], x: int, y: int
) -> tuple[int, int, int, int]:  # the smallest element containing the click
    best: tuple[int, int, int, int] | None = None
    for e in elements:
        left, top, w, h = e["left"], e["top"], e["width"], e["height"]
        if w <= 0 or h <= 0 or not (left <= x < left + w and top <= y < top + h):
            continue
        box = (int(left), int(top), int(left + w), int(top + h))
        if best is None or w * h < (best[2] - best[0]) * (best[3] - best[1]):
            best = box
    return best or (x - 2, y - 2, x + 3, y + 3)


def collect_miniwob_samples(
    *, per_task: int, tasks: tuple[str, ...] = PRETRAIN_TASKS, seed_base: int = TRAIN_SEED_BASE
) -> tuple[list[GroundingSample], DemoStats]:
    """`per_task` first-step oracle clicks per task on seeds seed_base, seed_base + 1, ..."""
    env = MiniWoBEnv()
    out: list[GroundingSample] = []
    skipped = 0
    started = time.perf_counter()
    try:
        for task in tasks:
            for i in range(per_task):
                spec = TaskSpec(
                    name=f"miniwob/{task}",
                    env_kind="miniwob",
                    env_config={"task": task},
                    seed=seed_base + i,
                )
                obs = env.reset(spec)
                action = oracle_action(env_kind="miniwob", task_name=spec.name, observation=obs)
                if action is None or action.type != ActionType.CLICK:
                    skipped += 1
                    continue
                assert action.x is not None and action.y is not None  # a click has both
                box = _target_box(obs.metadata["dom_elements"], action.x, action.y)
                out.append(
                    GroundingSample(
                        png=obs.screenshot_png,
                        width=obs.width,
                        height=obs.height,
                        instruction=obs.instruction,
                        x=int(action.x),
                        y=int(action.y),
                        box=box,
                        source=f"miniwob/{task}",
                    )
                )
    finally:
        env.close()
    return out, DemoStats(len(out), skipped, time.perf_counter() - started)


def main(argv: list[str]) -> None:
    """`PATH PER_TASK`: collect and pickle the samples (`training.pretrain.load_samples`)."""
    path, per_task = Path(argv[0]), int(argv[1])
    samples, stats = collect_miniwob_samples(per_task=per_task)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(samples))
    print(f"{stats.collected} samples ({stats.skipped} skipped) in {stats.seconds:.0f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
