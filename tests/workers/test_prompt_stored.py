"""What the policy saw is what it trains on: a step stores the prompt it was given
(`Step.prompt`, images as references to the trajectory's steps), and the trainer's samples
read it back instead of rebuilding it. Driven through the real episode runner on the sim
backend with the scripted oracle, whose every request is kept to compare against."""

from __future__ import annotations

from typing import Any

import pytest

from datamanager.models import Run, Step, Trajectory
from datamanager.policies import policy_geometry
from datamanager.services import episodes
from datamanager.services.batches import trajectory_samples
from envmanager.oracle_policy import OracleEndpoint
from workers.config_mapping import episode_config
from workers.env_cache import TaskEnv
from workers.episode_runner import DbRecorder, episode_run

pytestmark = pytest.mark.django_db


class Seen:
    """The oracle, keeping the messages of every request it answered."""

    def __init__(self, oracle: OracleEndpoint) -> None:
        self.oracle = oracle
        self.messages: list[list[dict[str, Any]]] = []

    def complete(self, messages: list[dict[str, Any]], **kwargs: Any):
        self.messages.append(messages)
        return self.oracle.complete(messages, **kwargs)


def test_the_trainer_trains_on_the_prompt_the_policy_was_given(settings):
    from datamanager.models import Task
    from tests.datamanager.factories import make_running_run

    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    Task.objects.create(name="sim/three", env_kind="sim", env_config={"targets": 3},
                        instruction="Click the three targets")  # fmt: skip
    run = make_running_run({
        "policy": "oracle",
        "tasks": {"env_kinds": ["sim"], "instances": 1},
        "env": {"miniwob_slots": 0, "sim_slots": 1},
        "rollout": {"max_images": 2},
    })  # fmt: skip
    cfg = run.cfg
    claim = episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("sim",))
    assert claim is not None
    oracle = OracleEndpoint(geometry=policy_geometry(cfg.policy), coords=cfg.rollout.coords)
    seen = Seen(oracle)
    env = TaskEnv(backend="sim", env_config=claim.task.env_config, env=cfg.env,
                  timeout_s=cfg.env.step_timeout_s, oracle=oracle)  # fmt: skip
    outcome = episode_run(
        trajectory_id=claim.trajectory_id,
        task=claim.task,
        env=env,
        policy=seen,
        recorder=DbRecorder(claim.trajectory_id),
        config=episode_config(cfg, step_cap=claim.step_cap, seed=claim.decode_seed),
    )
    assert outcome.end.name == "RAN", outcome
    traj = Trajectory.objects.get(pk=claim.trajectory_id)
    steps = list(Step.objects.filter(trajectory=traj).order_by("index"))
    assert len(steps) == len(seen.messages) >= 3
    # Stored with references, not pixels: the third step's prompt names steps 1 and 2.
    refs = [p["step"] for m in steps[2].prompt for p in m["content"]
            if isinstance(m["content"], list) and p.get("type") == "step_image"]  # fmt: skip
    assert refs == [1, 2]

    # The run's prompt setting changes after the episode (one screenshot, not two):
    # the trainer still trains each step on exactly what the policy saw.
    rollout = {**run.config["rollout"], "max_images": 1}
    Run.objects.filter(pk=run.pk).update(config={**run.config, "rollout": rollout})
    run.refresh_from_db()
    samples = trajectory_samples(traj, steps, group_id=0, cfg=run.cfg, is_demo=False)
    assert [s.messages for s in samples] == seen.messages
