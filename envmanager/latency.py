"""Latency injection: make a fast environment behave like a slow one (benchmarks).

`DARTBOARD_ENV_LATENCY=osworld` wraps every env so that a reset takes 20-60 s and a step
2-5 s (uniform), like an OSWorld VM, on top of the real browser's own time;
`DARTBOARD_ENV_LATENCY_SCALE` (default 1) multiplies both so a benchmark can compress time.
The sleeps are real waits, so the slot is busy in reset/step exactly as it would be.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from core.protocol import Action, ActionType, Env, Evaluation, Observation, TaskSpec


@dataclass(frozen=True)
class LatencyProfile:
    reset_s: tuple[float, float]
    step_s: tuple[float, float]

    def scaled(self, factor: float) -> LatencyProfile:
        return LatencyProfile(
            reset_s=(self.reset_s[0] * factor, self.reset_s[1] * factor),
            step_s=(self.step_s[0] * factor, self.step_s[1] * factor),
        )


PROFILES = {"osworld": LatencyProfile(reset_s=(20.0, 60.0), step_s=(2.0, 5.0))}


class LatencyEnv:
    """An Env that waits as long as `profile` says before each reset and step."""

    def __init__(self, env: Env, profile: LatencyProfile, *, seed: int | None = None) -> None:
        self.env = env
        self.kind = env.kind
        self.profile = profile
        self.rng = random.Random(seed)

    def reset(self, task: TaskSpec) -> Observation:
        time.sleep(self.rng.uniform(*self.profile.reset_s))
        return self.env.reset(task)

    def step(self, action: Action) -> Observation:
        time.sleep(self.rng.uniform(*self.profile.step_s))
        return self.env.step(action)

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        return self.env.evaluate(ended_by=ended_by)

    def close(self) -> None:
        self.env.close()


def profile_from_settings(name: str, scale: float) -> LatencyProfile | None:
    if not name or name == "off":
        return None
    if name not in PROFILES:
        raise ValueError(f"DARTBOARD_ENV_LATENCY={name!r}: use off or {', '.join(PROFILES)}")
    return PROFILES[name].scaled(scale)
