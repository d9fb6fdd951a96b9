"""Pre-collecting oracle demonstrations: real episodes in real environments, solved by the
scripted oracles, stored as the model would have written them (model-space coordinates)."""

from __future__ import annotations

from dataclasses import dataclass

from core.actions import CoordSpace, format_screen_action
from core.imaging import ImageGeometry
from core.protocol import Env, TaskSpec
from core.steps import StepRecord
from envmanager.oracles import oracle_action


@dataclass(frozen=True)
class DemoOutcome:
    steps: list[StepRecord]  # StepRecord.demonstration: screen, reply, screen-pixel action
    instruction: str
    reward: float
    success: bool


def collect_demo(
    *,
    env: Env,
    task: TaskSpec,
    max_steps: int = 15,
    geometry: ImageGeometry,
    coords: CoordSpace = "pixel",
) -> DemoOutcome:
    """One oracle episode, written in the model coordinates of the policy whose processor
    has `geometry` (the run's policy: its warm start clones these exact tokens). Each step's
    text is exactly what parse_output reads back."""
    obs = env.reset(task)
    instruction = obs.instruction or task.instruction
    steps: list[StepRecord] = []
    for _ in range(max_steps):
        action = oracle_action(env_kind=task.env_kind, task_name=task.name, observation=obs)
        if action is None:
            break
        # No canned thought: a demo in another format makes the warm start a format change
        # (measured BC loss 7-9 nats/token on such demos).
        thought = ""
        raw = format_screen_action(
            action, screen_size=(obs.width, obs.height), geometry=geometry, coords=coords
        )
        steps.append(
            StepRecord.demonstration(
                index=len(steps),
                screenshot_png=obs.screenshot_png,
                width=obs.width,
                height=obs.height,
                raw_output=raw,
                thought=thought,
                action=action.to_json(),
            )
        )
        if action.ends_episode:
            break
        obs = env.step(action)
    ev = env.evaluate()
    return DemoOutcome(steps=steps, instruction=instruction, reward=ev.reward, success=ev.success)
