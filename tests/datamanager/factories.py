"""Factories for data-manager tests: tasks, runs and finished episodes."""

from __future__ import annotations

import random

from datamanager.config import RunConfig
from datamanager.models import Run, RunStatus, Task
from datamanager.services import episodes
from datamanager.services.runs import run_create
from tests.conftest import png_bytes


def make_tasks(n: int = 2, *, split: str = "train") -> list[Task]:
    return [
        Task.objects.create(
            name=f"miniwob/t{i}",
            env_kind="miniwob",
            env_config={"task": f"t{i}"},
            instruction=f"Click button {i}",
            split=split,
        )
        for i in range(n)
    ]


def make_running_run(config: dict | None = None) -> Run:
    run = run_create(name="r", config=RunConfig.from_dict(config or {}))
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
    run.refresh_from_db()
    episodes.taskstats_ensure(run=run)
    return run


def play(
    run: Run,
    *,
    success: bool,
    steps: int = 2,
    version: int = 0,
    slot_id=None,
    rng: random.Random | None = None,
) -> int:
    """Claim the next task and record an episode of `steps` steps; returns the trajectory id."""
    rng = rng or random.Random(0)
    claim = episodes.task_claim(run_id=run.pk, slot_id=slot_id, env_kinds=("miniwob",))
    assert claim is not None
    for i in range(steps):
        x, y = rng.randrange(10, 150), rng.randrange(60, 200)
        episodes.step_record(
            trajectory_id=claim.trajectory_id,
            index=i,
            screenshot_png=png_bytes(color=(i * 20, 90, 200)),
            width=160,
            height=210,
            raw_output=f"Thought: click it\nAction: click(start_box='({x},{y})')",
            thought="click it",
            action={"type": "click", "x": x, "y": y},
            parse_error="",
            prompt_tokens=80,
            response_tokens=12,
            rollout_logprobs=[],
            mean_entropy=rng.random(),
            policy_version=version,
            env_ms=50.0,
            model_ms=80.0,
        )
    episodes.trajectory_finish(
        trajectory_id=claim.trajectory_id,
        status="succeeded" if success else "failed",
        reward=1.0 if success else 0.0,
    )
    return claim.trajectory_id
