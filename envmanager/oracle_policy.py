"""The scripted oracle behind the policy contract, for evaluation and slot tests.

`OracleEndpoint.complete()` answers like a model would: the oracle's next action written as
UI-TARS text in model-image coordinates. The episode runner parses it, maps it back to the
screen and steps the env exactly as it does for a model, so an oracle run measures what the
harness itself loses (nothing, if it is right). `ObservedEnv` lets the oracle see the DOM.
"""

from __future__ import annotations

import time
from typing import Any

from core.actions import CoordSpace, format_screen_action
from core.completion import Completion
from core.imaging import ImageGeometry
from core.protocol import Action, ActionType, Env, Evaluation, Observation, TaskSpec
from envmanager.oracles import oracle_action


class OracleEndpoint:
    def __init__(self, *, geometry: ImageGeometry, coords: CoordSpace = "pixel") -> None:
        self.geometry = geometry
        self.coords = coords
        self.task: TaskSpec | None = None
        self.observation: Observation | None = None

    def complete(self, messages: list[dict[str, Any]], **_: Any) -> Completion:
        started = time.perf_counter()
        if self.task is None or self.observation is None:
            raise RuntimeError("OracleEndpoint used before its ObservedEnv was reset")
        obs = self.observation
        action = oracle_action(
            env_kind=self.task.env_kind, task_name=self.task.name, observation=obs
        )
        if action is None:
            action = Action(type=ActionType.FINISHED, text="done")
        text = format_screen_action(
            action, screen_size=(obs.width, obs.height), geometry=self.geometry, coords=self.coords
        )
        return Completion.scripted(text, started=started, served_by="oracle")


class ObservedEnv:
    """Passes every call through and shows the oracle each observation."""

    def __init__(self, env: Env, endpoint: OracleEndpoint) -> None:
        self.env = env
        self.kind = env.kind
        self.endpoint = endpoint

    def reset(self, task: TaskSpec) -> Observation:
        obs = self.env.reset(task)
        self.endpoint.task, self.endpoint.observation = task, obs
        return obs

    def step(self, action: Action) -> Observation:
        obs = self.env.step(action)
        self.endpoint.observation = obs
        return obs

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        return self.env.evaluate(ended_by=ended_by)

    def close(self) -> None:
        self.env.close()
