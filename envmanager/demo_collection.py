"""Pre-collecting oracle demonstrations: real episodes in real environments, solved by the
scripted oracles, stored as the model would have written them (model-space coordinates)."""

from __future__ import annotations

from dataclasses import dataclass

from core.actions import CoordSpace, format_action, from_screen, model_image_size
from core.protocol import Env, TaskSpec
from envmanager.oracles import oracle_action


@dataclass(frozen=True)
class DemoOutcome:
    steps: list[tuple[bytes, int, int, str, str, dict]]  # png, w, h, raw_output, thought, action
    instruction: str
    reward: float
    success: bool


def collect_demo(
    *,
    env: Env,
    task: TaskSpec,
    max_steps: int = 15,
    min_pixels: int,
    max_pixels: int,
    coords: CoordSpace = "pixel",
) -> DemoOutcome:
    """One oracle episode. Each step's text is exactly what parse_output reads back."""
    obs = env.reset(task)
    instruction = obs.instruction or task.instruction
    steps = []
    for _ in range(max_steps):
        action = oracle_action(env_kind=task.env_kind, task_name=task.name, observation=obs)
        if action is None:
            break
        model_size = model_image_size(
            width=obs.width, height=obs.height, min_pixels=min_pixels, max_pixels=max_pixels
        )
        model_action = from_screen(
            action, screen_size=(obs.width, obs.height), model_size=model_size, coords=coords
        )
        # No canned thought: it carries nothing the action does not, and the shipped policy
        # was pretrained to answer with the action alone (a demo in another format makes the
        # warm start a format change: measured BC loss 7-9 nats/token on such demos).
        thought = ""
        raw = format_action(model_action, coords=coords)
        steps.append((obs.screenshot_png, obs.width, obs.height, raw, thought, action.to_json()))
        if action.ends_episode:
            break
        obs = env.step(action)
    ev = env.evaluate()
    return DemoOutcome(steps=steps, instruction=instruction, reward=ev.reward, success=ev.success)
