"""Every model round-trips through the database (SQLite by default, PostgreSQL in CI)."""

import pytest
from django.core.files.base import ContentFile
from django.db import IntegrityError
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import (
    EnvSlot,
    PolicyVersion,
    RewardOverride,
    Run,
    Step,
    Task,
    TaskStat,
    TrainUpdate,
    Trajectory,
)
from datamanager.services.runs import run_create

pytestmark = pytest.mark.django_db


def _task(name="miniwob/click-test"):
    return Task.objects.create(
        name=name,
        env_kind="miniwob",
        env_config={"task": "click-test"},
        split="train",
        tags=["click", "easy"],
    )


def test_full_graph_round_trips(researcher):
    task = _task()
    run = run_create(name="first", config=RunConfig(), owner=researcher)
    stat = TaskStat.objects.create(run=run, task=task, attempts=3, successes=2, success_rate=0.67)
    slot = EnvSlot.objects.create(
        name="vm:1:0", host="vm", backend="miniwob", last_heartbeat=timezone.now()
    )
    traj = Trajectory.objects.create(
        run=run,
        task=task,
        env_slot=slot,
        status="succeeded",
        reward=1.0,
        length=2,
        policy_versions=[0, 1],
    )
    update = TrainUpdate.objects.create(
        run=run, number=1, policy_version=0, metrics={"loss": 0.5, "staleness": {"0": 3}}
    )
    step = Step.objects.create(
        trajectory=traj,
        index=0,
        raw_output="Thought: go\nAction: click(start_box='(1,2)')",
        action={"type": "click", "x": 1, "y": 2},
        rollout_logprobs=[-0.1, -2.5],
        mean_entropy=0.7,
        policy_version=1,
        env_ms=80.5,
        model_ms=120.0,
        trained_in_update=update,
        entropy_kept=True,
        advantage=0.5,
        is_weight=0.98,
    )
    step.screenshot.save("s.png", ContentFile(b"\x89PNG fake"), save=True)
    pv = PolicyVersion.objects.create(
        run=run, version=1, checkpoint="checkpoints/1/1", reached_workers=["w1"]
    )
    RewardOverride.objects.create(
        trajectory=traj,
        user=researcher,
        old_reward=1.0,
        new_reward=0.0,
        reason="clicked the wrong one",
    )

    got = Step.objects.select_related("trajectory__run", "trajectory__task").get(pk=step.pk)
    assert got.rollout_logprobs == [-0.1, -2.5]
    assert got.action == {"type": "click", "x": 1, "y": 2}
    assert got.trajectory.run.config == RunConfig().to_dict()
    assert got.trajectory.task.tags == ["click", "easy"]
    assert got.trajectory.policy_versions == [0, 1]
    assert got.screenshot.read() == b"\x89PNG fake"
    assert TaskStat.objects.get(pk=stat.pk).success_rate == pytest.approx(0.67)
    assert PolicyVersion.objects.get(pk=pv.pk).reached_workers == ["w1"]
    assert Run.objects.get(pk=run.pk).owner == researcher
    assert TrainUpdate.objects.get(pk=update.pk).metrics["staleness"] == {"0": 3}
    assert traj.reward_overrides.get().reason == "clicked the wrong one"


def test_one_step_per_index_and_one_stat_per_task():
    task = _task()
    run = run_create(name="r", config=RunConfig())
    traj = Trajectory.objects.create(run=run, task=task)
    Step.objects.create(trajectory=traj, index=0)
    with pytest.raises(IntegrityError):
        Step.objects.create(trajectory=traj, index=0)


def test_task_stat_unique_per_run_and_task():
    task = _task()
    run = run_create(name="r", config=RunConfig())
    TaskStat.objects.create(run=run, task=task)
    with pytest.raises(IntegrityError):
        TaskStat.objects.create(run=run, task=task)
