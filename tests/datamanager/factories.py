"""Factories for data-manager tests: tasks, runs and finished episodes."""

from __future__ import annotations

import random
from typing import Any

from core.steps import StepRecord
from datamanager.config import RunConfig
from datamanager.models import Run, RunStatus, Step, Task
from datamanager.services import episodes, steps
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
        step_record(
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


def step_record(
    *,
    trajectory_id: int,
    index: int,
    screenshot_png: bytes,
    width: int,
    height: int,
    raw_output: str,
    thought: str,
    action: dict[str, Any] | None,
    parse_error: str,
    prompt_tokens: int,
    response_tokens: int,
    rollout_logprobs: list[float],
    response_token_ids: list[int] | None = None,
    mean_entropy: float | None,
    policy_version: int | None,
    env_ms: float | None,
    model_ms: float | None,
    head: steps.TrajectoryHead | None = None,
    resume: bool = False,
    prompt: list[dict[str, Any]] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> Step:
    """`steps.steps_store` of a step given field by field, as the tests write them (its
    trajectory's head read here when none is given)."""
    if head is None:
        head = steps.trajectory_head(trajectory_id=trajectory_id)
    elif head.pk != trajectory_id:
        raise ValueError(f"step of trajectory {trajectory_id} given the head of {head.pk}")
    record = StepRecord(
        index=index,
        screenshot_png=screenshot_png,
        width=width,
        height=height,
        raw_output=raw_output,
        thought=thought,
        action=action,
        parse_error=parse_error,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        rollout_logprobs=rollout_logprobs,
        response_token_ids=response_token_ids or [],
        mean_entropy=mean_entropy,
        policy_version=policy_version,
        env_ms=env_ms,
        model_ms=model_ms,
        prompt=prompt or [],
        prompt_token_ids=prompt_token_ids or [],
    )
    [stored] = steps.steps_store(writes=[steps.StepWrite(head=head, record=record)], resume=resume)
    return stored
