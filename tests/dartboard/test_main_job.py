"""The main job's presets, and what its run page shows where DART's progress is measured: the
scheduled greedy evaluations of each version on the training instances and on held-out
seeds (charted per version with the 95% interval), and what the run is busy with, and for
how long, where no chart moves."""

from __future__ import annotations

import pytest
from django.utils import timezone

from datamanager.config import ConfigError, RunConfig
from datamanager.curation import group_seed
from datamanager.models import EvalJob, PolicyVersion, Task, TaskStat, TrainUpdate, Trajectory
from datamanager.services.evaluations import eval_lanes, eval_schedule_next
from hostagent.main_job import MAIN_MINIWOB_TASKS, main_run_config
from tests.datamanager.factories import make_running_run

pytestmark = pytest.mark.django_db


def _miniwob_tasks() -> list[Task]:
    return [
        Task.objects.create(name=f"miniwob/{n}", env_kind="miniwob", env_config={"task": n})
        for n in MAIN_MINIWOB_TASKS
    ]


def test_the_presets_are_valid_runs_and_make_run_trains_no_desktop():
    _miniwob_tasks()
    Task.objects.create(name="desktop/double-click", env_kind="desktop")
    main = main_run_config("miniwob")
    assert main.tasks.env_kinds == ["miniwob"] and main.env.desktop_slots == 0
    assert main.trainer.warm_start_bc_updates == 0  # the first RL version within minutes
    assert main.evaluation.train_instances and main.evaluation.heldout_k > 0
    assert not main.evaluation.eval_split  # its 23 tasks would take the slots from training
    assert eval_lanes(main) == 1 and len(main.env.slots()) == 3  # a third of the slots' time
    desktop = main_run_config("desktop")
    assert desktop.tasks.names == ["desktop/double-click"] and desktop.env.miniwob_slots == 0
    # make run-desktop starts from the policy pretrained on desktops, charts greedy success on
    # its own (fixed) tasks on one of its two slots, and sends one screenshot per step.
    assert desktop.policy == "shipped-desktop" and desktop.rollout.max_images == 1
    assert desktop.evaluation.train_instances and desktop.tasks.instances == 1
    assert eval_lanes(desktop) == 1 and len(desktop.env.slots()) == 2
    on_vllm = main_run_config("vllm")  # make run-vllm: the main job, LoRA served by vLLM
    assert on_vllm.rollout.backend == "vllm" and on_vllm.trainer.lora_rank == 16
    assert on_vllm.tasks == main.tasks and on_vllm.env == main.env
    with pytest.raises(ValueError, match="unknown preset 'osworld'; presets: miniwob, vllm, desk"):
        main_run_config("osworld")


def _finish(job: EvalJob) -> None:
    EvalJob.objects.filter(pk=job.pk).update(status="finished")


def test_a_version_is_evaluated_on_the_training_instances_and_on_held_out_seeds():
    tasks = _miniwob_tasks()[:2]
    run = make_running_run(
        {
            "seed": 3,
            "tasks": {"names": [t.name for t in tasks], "instances": 4},
            "evaluation": {"every_n_versions": 2, "train_instances": True, "heldout_k": 3},
        }
    )
    (baseline,) = eval_schedule_next(run_id=run.pk)
    assert (baseline.scope, baseline.policy) == ("train_instances", "shipped")  # v0: the start
    _finish(baseline)
    (baseline_heldout,) = eval_schedule_next(run_id=run.pk)
    assert (baseline_heldout.scope, baseline_heldout.policy_version) == ("heldout", 0)
    _finish(baseline_heldout)
    assert eval_schedule_next(run_id=run.pk) == []  # nothing published yet
    PolicyVersion.objects.create(run=run, version=1, checkpoint="/ckpt/v1")
    assert eval_schedule_next(run_id=run.pk) == []  # every 2nd version
    PolicyVersion.objects.create(run=run, version=2, checkpoint="/ckpt/v2")
    (train,) = eval_schedule_next(run_id=run.pk)
    _finish(train)
    (heldout,) = eval_schedule_next(run_id=run.pk)
    assert (train.policy, train.k, train.task_names) == (
        f"run:{run.pk}:v2",
        4,
        sorted(t.name for t in tasks),
    )
    # The harness plays seeds job.seed * 1000 + i: exactly the seeds the run's groups cycle
    # through (group indexes count from 1), and none of them on the held-out side.
    instance_seeds = {
        group_seed(run_seed=3, group_pk=0, group_index=g, instances=4, heldout_seed=777)
        for g in range(1, 9)
    }
    assert {train.seed * 1000 + i for i in range(train.k)} == instance_seeds
    assert not {heldout.seed * 1000 + i for i in range(heldout.k)} & instance_seeds
    assert heldout.k == 3 and heldout.name.endswith("(held-out seeds)")


def test_training_seeds_never_are_held_out_seeds_fixed_instances_or_fresh():
    """What the held-out chart scores is unseen: no training group plays a held-out seed,
    whether it cycles through fixed instances or takes a fresh seed each group
    (tasks.instances 0), whichever run seed and however many groups the run made."""
    for heldout_seed in (777, 0, 3):
        heldout = {heldout_seed * 1000 + i for i in range(1000)}  # every k a job may take
        for run_seed in (0, 1, 3):
            fixed = {group_seed(run_seed=run_seed, group_pk=0, group_index=g, instances=100,
                                heldout_seed=heldout_seed) for g in range(1, 101)}  # fmt: skip  # one set
            # The groups whose primary keys would land on the held-out block, and around it.
            near = heldout_seed * 1000 - run_seed * 1_000_003
            fresh = {
                group_seed(run_seed=run_seed, group_pk=pk, group_index=1, instances=0,
                           heldout_seed=heldout_seed)
                for pk in range(max(near - 50, 1), near + 1050)
            }  # fmt: skip  # one set
            assert not (fixed | fresh) & heldout, (heldout_seed, run_seed)
    # The run config refuses the one held-out seed that is the fixed instances' block.
    with pytest.raises(ConfigError, match="gives the training instances' seeds"):
        RunConfig.from_dict({"seed": 3, "evaluation": {"heldout_seed": 500_003}})


def test_evaluation_takes_its_share_of_slots_and_skips_versions_it_could_not_keep_up_with():
    """One scheduled job at a time on a third of the slots; versions published while one
    runs are not queued: the next job evaluates the newest, and the chart has a gap."""
    tasks = _miniwob_tasks()[:3]
    run = make_running_run(
        {
            "tasks": {"names": [t.name for t in tasks], "instances": 2},
            "env": {"miniwob_slots": 3},
            "evaluation": {"every_n_versions": 1, "train_instances": True, "heldout_k": 2,
                           "eval_split": False, "slot_share": 1 / 3},
        }
    )  # fmt: skip
    (first,) = eval_schedule_next(run_id=run.pk)
    assert first.shards == 1  # one slot of three
    for version in range(1, 6):
        PolicyVersion.objects.create(run=run, version=version, checkpoint=f"/ckpt/v{version}")
        assert eval_schedule_next(run_id=run.pk) == []  # one under way: nothing queues
    _finish(first)
    (second,) = eval_schedule_next(run_id=run.pk)
    assert (second.policy_version, second.scope) == (0, "heldout")  # the pair stays together
    _finish(second)
    (newest,) = eval_schedule_next(run_id=run.pk)
    assert (newest.policy_version, newest.scope) == (5, "train_instances")  # v1-v4 skipped
    assert EvalJob.objects.filter(run=run).count() == 3


def test_a_run_with_many_instances_evaluates_the_first_k_of_them():
    tasks = _miniwob_tasks()[:2]
    run = make_running_run(
        {
            "tasks": {"names": [t.name for t in tasks], "instances": 100},
            "evaluation": {"every_n_versions": 1, "train_instances": True, "train_instances_k": 5},
        }
    )
    (train,) = eval_schedule_next(run_id=run.pk)
    assert train.k == 5 and train.total == 5 * len(tasks)
    first_groups = {
        group_seed(run_seed=0, group_pk=0, group_index=g, instances=100, heldout_seed=777)
        for g in range(1, 6)
    }
    assert {train.seed * 1000 + i for i in range(train.k)} == first_groups
    with pytest.raises(ConfigError, match="has 30 training instances per task; got 31"):
        RunConfig.from_dict(
            {"tasks": {"instances": 30},
             "evaluation": {"train_instances": True, "train_instances_k": 31}}
        )  # fmt: skip


def test_greedy_success_per_version_is_charted_with_its_interval(ada_client):
    (task,) = _miniwob_tasks()[:1]
    run = make_running_run({"tasks": {"names": [task.name], "instances": 10}})
    for version, scope, successes in ((0, "train_instances", 3), (4, "train_instances", 8),
                                      (0, "heldout", 2), (4, "heldout", 3)):  # fmt: skip
        job = EvalJob.objects.create(
            name="e", policy="shipped", run=run, policy_version=version, scope=scope,
            task_names=[task.name], k=10, status="finished",
        )  # fmt: skip
        for i in range(10):
            Trajectory.objects.create(
                task=task, run=run, eval_job=job, purpose="eval", seed=i,
                status="succeeded" if i < successes else "failed", finished_at=timezone.now(),
            )  # fmt: skip
    running = EvalJob.objects.create(name="e", policy="shipped", run=run, policy_version=8,
                                     scope="train_instances", task_names=[task.name], k=10)  # fmt: skip
    figure = ada_client.get(f"/runs/{run.pk}/charts.json").json()["versions"]
    lines = {t["name"]: t for t in figure["data"]}
    train, heldout = lines["training instances"], lines["held-out seeds"]
    assert train["x"] == [0, 4] and train["y"] == [0.3, 0.8]  # the running job is not a point
    assert heldout["x"] == [0, 4] and heldout["y"] == [0.2, 0.3]
    # The 95% Wilson interval of 8/10: 0.490 to 0.943.
    assert train["error_y"]["array"][1] == pytest.approx(0.943 - 0.8, abs=1e-3)
    assert train["error_y"]["arrayminus"][1] == pytest.approx(0.8 - 0.490, abs=1e-3)
    assert running.status == "queued"


def test_the_run_page_says_what_the_dead_time_is_and_how_long_it_takes(ada_client):
    (task,) = _miniwob_tasks()[:1]
    run = make_running_run({"trainer": {"warm_start_bc_updates": 4}})
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "Warm start: behaviour cloning on the experience pool, 0 of 4 updates done" in page
    for number in (1, 2):
        TrainUpdate.objects.create(run=run, number=number, policy_version=0,
                                   metrics={"kind": "warm_start", "duration_s": 45.0})  # fmt: skip
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "2 of 4 updates done, about 90 s left (45 s an update so far)" in page
    job = EvalJob.objects.create(
        name="e", policy="shipped", run=run, policy_version=4, scope="heldout",
        task_names=[task.name], k=20, total=20, done=5, status="running",
    )  # fmt: skip
    EvalJob.objects.filter(pk=job.pk).update(
        created_at=timezone.now() - timezone.timedelta(seconds=60)
    )
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "Evaluating v4 greedily on held-out seeds: 5 of 20 episodes, about 3 min left" in page


def test_the_run_page_names_the_tasks_still_at_zero_with_their_rollouts(ada_client):
    tasks = _miniwob_tasks()[:3]
    run = make_running_run({"tasks": {"names": [t.name for t in tasks]}})
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="unsolved-tasks"' not in page  # nothing tried yet: nothing to say
    stats = {s.task.name: s for s in TaskStat.objects.filter(run=run).select_related("task")}
    for name, attempts, successes in ((tasks[0].name, 12, 0), (tasks[1].name, 12, 3),
                                      (tasks[2].name, 5, 0)):  # fmt: skip
        TaskStat.objects.filter(pk=stats[name].pk).update(attempts=attempts, successes=successes)
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    # Only the task at 0% after enough rollouts (5 rollouts may just be bad luck).
    assert f"No success yet on 1 task after 8 or more rollouts: {tasks[0].name} (0 of 12)" in page
    assert f"{tasks[2].name} (0 of" not in page


def test_evaluating_training_instances_needs_instances_and_held_out_seeds_must_differ():
    with pytest.raises(ConfigError, match=r"no fixed training instances: set tasks\.instances"):
        RunConfig.from_dict({"evaluation": {"train_instances": True}})
    with pytest.raises(ConfigError, match="500002 gives the training instances' seeds"):
        RunConfig.from_dict({"seed": 2, "evaluation": {"heldout_seed": 500_002, "heldout_k": 2}})
