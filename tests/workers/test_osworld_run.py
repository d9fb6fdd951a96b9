"""OSWorld-format tasks through the workers' real paths on a sandboxed Dartboard desktop
serving OSWorld's protocol: imported with `import_tasks`, evaluated by the evaluation
harness (per-task success like any task), pre-collected as oracle demos, rolled out by an
env slot named with its VM's address under the untrained tiny policy, and trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.management import call_command

from datamanager.models import EnvSlot, PolicyVersion, Task, TrainUpdate, Trajectory
from datamanager.services import env_slots, episodes
from rollout.local_server import LocalPolicyServer
from tests.datamanager.factories import make_running_run
from workers import slot_worker, training_loop

pytestmark = [pytest.mark.desktop]

ROOT = Path(__file__).resolve().parents[2]
EVAL_TASKS = [
    "osworld/dartboard-terminal-mkdir",
    "osworld/dartboard-editor-type-save",
    "osworld/dartboard-infeasible-spotify",
]


@pytest.fixture
def osworld_tasks(osworld_desktop):
    call_command("import_tasks", str(ROOT / "tasks" / "osworld"))
    return Task.objects.filter(env_kind="osworld")


@pytest.mark.django_db
def test_the_evaluation_harness_reports_osworld_tasks_per_task(
    osworld_tasks, osworld_desktop, tmp_path
):
    for task in osworld_tasks.filter(name__in=EVAL_TASKS):
        # A task may name its own VM; evaluations outside a run use that.
        task.env_config = {**task.env_config, "address": osworld_desktop.address}
        task.split = "eval"
        task.save()
    out = tmp_path / "osworld"
    call_command("evaluate", policy="oracle", tasks="split:eval", k=1, out=out)
    report = json.loads(out.with_suffix(".json").read_text())
    rates = {row["task"]: row["success_rate"] for row in report["tasks"]}
    assert rates == dict.fromkeys(EVAL_TASKS, 1.0)
    assert Trajectory.objects.filter(purpose="eval", status="succeeded").count() == 3


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_run_rolls_out_and_trains_on_an_osworld_task(
    osworld_tasks, osworld_desktop, tiny_policy_dir, settings, tmp_path, live_work_keys_cleared
):
    settings.CHECKPOINT_ROOT = tmp_path / "checkpoints"
    name = "osworld/dartboard-terminal-mkdir"
    # A pool demo (the oracle, through the real collect_demos path) for the all-failed group.
    call_command(
        "collect_demos",
        per_task=1,
        tasks=name,
        kinds="osworld",
        policy=str(tiny_policy_dir),
        osworld_address=osworld_desktop.address,
    )
    assert Trajectory.objects.filter(task__name=name, in_pool=True).count() == 1
    run = make_running_run(
        {
            "policy": str(tiny_policy_dir),
            "tasks": {"env_kinds": ["osworld"], "names": [name]},
            "env": {"miniwob_slots": 0, "osworld_addresses": [osworld_desktop.address]},
            "curation": {"n_max": 2, "n_min": 2, "default_step_cap": 2},
            "trainer": {"min_groups": 1, "lr": 1e-3, "kl_coef": 0.0, "max_updates": 1},
        }
    )
    with LocalPolicyServer(tiny_policy_dir) as url:  # the test settings' inference token
        settings.DARTBOARD_INFERENCE_URLS = [url]
        outcome = slot_worker.serve_slice(
            run_id=run.pk, backend="osworld", index=0, max_seconds=180, max_episodes=2
        )
    assert outcome.reason == "2 episodes done"
    slot = EnvSlot.objects.get(run=run)
    assert slot.name.endswith(f":osworld:0@{osworld_desktop.address}")  # the env wall's tile
    rollouts = Trajectory.objects.filter(run=run, purpose="train")
    assert rollouts.count() == 2 and all(t.status in ("succeeded", "failed") for t in rollouts)
    assert all(t.steps.count() >= 1 for t in rollouts)
    assert not all(t.status == "succeeded" for t in rollouts)  # the untrained policy fails
    training_loop.trainers_forget_all()
    assert training_loop.train_for(run_id=run.pk, max_seconds=180) == "max_updates reached"
    update = TrainUpdate.objects.get(run=run)
    assert update.metrics["n_samples"] > 0
    assert PolicyVersion.objects.filter(run=run, version=1).exists()


@pytest.mark.django_db
def test_an_evaluator_failure_is_an_error_on_the_trajectory_and_the_slot(
    osworld_tasks, osworld_desktop
):
    task = osworld_tasks.get(name="osworld/dartboard-terminal-mkdir")
    spec = dict(task.env_config["osworld"])
    spec["evaluator"] = {  # exact_match reads rules["expected"]: this rule makes it raise
        "func": "exact_match",
        "result": {"type": "vm_command_line", "command": ["echo", "yes"]},
        "expected": {"type": "rule", "rules": {"wanted": "yes\n"}},
    }
    task.env_config = {"osworld": spec}
    task.save()
    run = make_running_run(
        {
            "policy": "oracle",
            "tasks": {"env_kinds": ["osworld"], "names": [task.name]},
            "env": {"miniwob_slots": 0, "osworld_addresses": [osworld_desktop.address]},
        }
    )
    slot = env_slots.env_slot_register(
        name="t:1:osworld:0", host="t", backend="osworld", run_id=run.pk
    )
    claim = episodes.task_claim(run_id=run.pk, slot_id=slot.pk, env_kinds=("osworld",))
    cfg = run.cfg
    slot_worker._run_claim(claim, slot.pk, "osworld", cfg, client=None, index=0)
    traj = Trajectory.objects.get(pk=claim.trajectory_id)
    assert traj.status == "error" and traj.reward is None
    assert "osworld evaluator: exact_match failed: KeyError" in traj.error
    slot.refresh_from_db()
    assert slot.consecutive_failures == 1 and "exact_match failed" in slot.last_error
