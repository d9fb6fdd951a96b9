"""The `sim` backend: synthetic screens with exact targets and no browser, for load tests of
the control plane (bench/scale.py) and for runs that need many cheap slots.

A task shows `targets` numbered boxes (env_config {"targets": k}) on a 320x200 screen, or one of
`width` x `height` (a full-HD screen, as OSWorld's VMs have, costs a UI-TARS policy 2,691 prompt
tokens per screenshot); the episode succeeds when
they are clicked in order, 1 to k, without a click that misses. The boxes are drawn from the
task's seed, so a group of rollouts sees the same screen, and the observation carries them
(`metadata["targets"]`, `metadata["next"]`), so the scripted oracle (envmanager/oracles.py)
clicks each box's centre and a wrong click is known exactly.

The backend itself answers in well under a millisecond; `sim_env(latency=...)` wraps it in
`envmanager.latency.LatencyEnv` so that resets and steps take as long as an OSWorld VM's
(20-60 s and 2-5 s, times DARTBOARD_ENV_LATENCY_SCALE in a run).

    .venv/bin/python -c "from envmanager.sim_env import SimEnv; from core.protocol import TaskSpec; \
        print(SimEnv().reset(TaskSpec('sim/t', 'sim', {'targets': 3}, seed=1)).metadata)"
"""

from __future__ import annotations

import io
import random
from functools import lru_cache
from typing import Any

from PIL import Image, ImageDraw

from core.protocol import Action, ActionType, Env, Evaluation, Observation, TaskSpec
from envmanager.latency import LatencyEnv, LatencyProfile

WIDTH, HEIGHT = 320, 200  # the default screen
MAX_SIDE = 4096
BOX = 28  # target side in screen pixels: wide enough that the model-image round trip of the
# oracle's click (core.actions, pixels of the resized image) lands inside it
MAX_TARGETS = 12

Box = tuple[int, int, int, int]  # left, top, right, bottom (right/bottom exclusive)


def target_boxes(*, seed: int, count: int, width: int = WIDTH, height: int = HEIGHT) -> list[Box]:
    """`count` non-overlapping boxes on a grid of BOX+8 cells of a `width` x `height` screen,
    placed by `seed`."""
    if not 1 <= count <= MAX_TARGETS:
        raise ValueError(f"a sim task has 1 to {MAX_TARGETS} targets, got {count}")
    cell = BOX + 8
    cells = [(c, r) for r in range(1, height // cell) for c in range(width // cell)]
    picked = random.Random(seed).sample(cells, count)
    return [(c * cell + 4, r * cell + 4, c * cell + 4 + BOX, r * cell + 4 + BOX) for c, r in picked]


@lru_cache(maxsize=2048)
def _screen_png(seed: int, count: int, done: int, width: int, height: int) -> bytes:
    """The screen with targets 1..count, the first `done` greyed out (cached: a group's
    rollouts and every slot on the same instance draw the same screens)."""
    img = Image.new("RGB", (width, height), (246, 246, 250))
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 0, width, 30], fill=(255, 255, 176))
    draw.text((6, 9), f"Click 1 to {count} in order", fill=(0, 0, 0))
    boxes = target_boxes(seed=seed, count=count, width=width, height=height)
    for i, (left, top, right, bottom) in enumerate(boxes):
        fill = (190, 190, 190) if i < done else (60, 110, 220)
        draw.rectangle([left, top, right - 1, bottom - 1], fill=fill)
        draw.text((left + 9, top + 8), str(i + 1), fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


# A flaky environment for tests of the group rules: with env_config {"crash_first": n}, the
# first n resets of each (task, seed) in this process raise, as a VM that fails to boot.
_CRASHED: dict[tuple[str, int], int] = {}


class SimEnv:
    """One simulated screen; `reset` needs a task with env_config {"targets": k}."""

    kind = "sim"

    def __init__(self) -> None:
        self._seed = 0
        self._boxes: list[Box] = []
        self._size = (WIDTH, HEIGHT)
        self._next = 0
        self._misses = 0
        self._steps = 0

    def reset(self, task: TaskSpec) -> Observation:
        count = int(task.env_config.get("targets", 1))
        width = int(task.env_config.get("width", WIDTH))
        height = int(task.env_config.get("height", HEIGHT))
        if not (WIDTH <= width <= MAX_SIDE and HEIGHT <= height <= MAX_SIDE):
            raise ValueError(
                f"sim: a screen of {width}x{height}; from {WIDTH}x{HEIGHT} (room for "
                f"{MAX_TARGETS} targets) to {MAX_SIDE}x{MAX_SIDE} pixels"
            )
        self._size = (width, height)
        self._seed = task.seed if task.seed is not None else 0
        crashes = int(task.env_config.get("crash_first", 0))
        if crashes and _CRASHED.setdefault((task.name, self._seed), 0) < crashes:
            _CRASHED[(task.name, self._seed)] += 1
            raise RuntimeError(
                f"sim: simulated crash {_CRASHED[(task.name, self._seed)]} of {crashes} at "
                f"seed {self._seed} (env_config crash_first)"
            )
        self._boxes = target_boxes(seed=self._seed, count=count, width=width, height=height)
        self._next = self._misses = self._steps = 0
        return self._observe(task.instruction or f"Click the boxes 1 to {count} in order.")

    def step(self, action: Action) -> Observation:
        if not self._boxes:
            raise RuntimeError("SimEnv.step before reset")
        self._steps += 1
        if action.type == ActionType.CLICK and self._next < len(self._boxes):
            assert action.x is not None and action.y is not None  # a click has both
            left, top, right, bottom = self._boxes[self._next]
            if left <= action.x < right and top <= action.y < bottom:
                self._next += 1
            else:
                self._misses += 1
        elif action.type != ActionType.WAIT:
            self._misses += 1  # any other action on this screen is a mistake
        return self._observe("")

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        success = self._next == len(self._boxes) and self._misses == 0
        details: dict[str, Any] = {"clicked": self._next, "misses": self._misses}
        return Evaluation(reward=1.0 if success else 0.0, success=success, details=details)

    def close(self) -> None:
        self._boxes = []

    def _observe(self, instruction: str) -> Observation:
        count = len(self._boxes)
        return Observation(
            screenshot_png=_screen_png(self._seed, count, self._next, *self._size),
            width=self._size[0],
            height=self._size[1],
            instruction=instruction,
            metadata={"targets": self._boxes, "next": self._next, "step": self._steps},
            done=self._next == count or self._misses > 0,
        )


def sim_env(*, latency: LatencyProfile | None, seed: int | None = None) -> Env:
    """The sim backend, waiting as long as `latency` says before each reset and step."""
    env: Env = SimEnv()
    return env if latency is None else LatencyEnv(env, latency, seed=seed)


def sim_task_records() -> list[dict[str, Any]]:
    """Import records of the built-in sim tasks: `sim/click-K` for K = 1..12 boxes (train),
    and two for evaluation."""
    records = [
        {
            "name": f"sim/click-{k}",
            "env_kind": "sim",
            "env_config": {"targets": k, "max_steps": k + 2},
            "instruction": f"Click the boxes 1 to {k} in order.",
            "split": "train",
            "tags": ["sim"],
        }
        for k in range(1, MAX_TARGETS + 1)
    ]
    records += [
        {
            "name": f"sim/eval-click-{k}",
            "env_kind": "sim",
            "env_config": {"targets": k, "max_steps": k + 2},
            "instruction": f"Click the boxes 1 to {k} in order.",
            "split": "eval",
            "tags": ["sim"],
        }
        for k in (3, 8)
    ]
    return records
