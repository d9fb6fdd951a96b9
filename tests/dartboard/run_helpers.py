"""Runs and episodes made through the services the workers call, for the page tests."""

from __future__ import annotations

from datamanager.config import RunConfig
from datamanager.models import EnvSlot, Run, Task, Trajectory
from datamanager.services import runs as services
from datamanager.services.episodes import (
    task_claim,
    taskstats_ensure,
    trajectory_finish,
)
from tests.conftest import png_bytes
from tests.datamanager.factories import step_record


def make_run(owner=None, name="click-run", **cfg) -> Run:
    for t in ("click-button", "enter-text"):
        Task.objects.get_or_create(name=t, defaults={"env_kind": "miniwob", "instruction": t})
    run = services.run_create(name=name, config=RunConfig.from_dict(cfg), owner=owner)
    services.run_control(run_id=run.pk, action="start")
    taskstats_ensure(run=run)
    return run


def episode(run: Run, slot: EnvSlot | None, *, steps: int, success: bool | None, version=0):
    """A real episode through the services an env worker calls (success None: still running)."""
    claim = task_claim(run_id=run.pk, slot_id=slot.pk if slot else None, env_kinds=("miniwob",))
    actions = [
        {"type": "click", "x": 40, "y": 60},
        {"type": "type", "text": "hello"},
        {"type": "drag", "x": 10, "y": 10, "x2": 100, "y2": 150},
        {"type": "scroll", "x": 80, "y": 100, "direction": "down"},
    ]
    for i in range(steps):
        step_record(
            trajectory_id=claim.trajectory_id,
            index=i,
            screenshot_png=png_bytes(color=(i * 40 % 255, 90, 200)),
            width=160,
            height=210,
            raw_output=f"Thought: step {i}\nAction: click(...)",
            thought=f"thinking about step {i}",
            action=actions[i % len(actions)],
            parse_error="",
            prompt_tokens=100,
            response_tokens=12,
            rollout_logprobs=[-0.5, -0.25, -0.25],
            mean_entropy=0.7,
            policy_version=version,
            env_ms=42.0,
            model_ms=130.0,
        )
    if slot is not None:
        EnvSlot.objects.filter(pk=slot.pk).update(
            current_trajectory_id=claim.trajectory_id, status="busy"
        )
    if success is not None:
        trajectory_finish(
            trajectory_id=claim.trajectory_id,
            status="succeeded" if success else "failed",
            reward=1.0 if success else 0.0,
        )
    return Trajectory.objects.get(pk=claim.trajectory_id)
