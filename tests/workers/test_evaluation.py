"""Evaluation through the training path: the oracle loses nothing, a model is evaluated via
its own inference server, and evaluation data never feeds training or curation."""

import json

import pytest
from django.core.management import CommandError, call_command

from datamanager.models import EvalJob, Task, TaskStat, Trajectory
from datamanager.services import batches
from datamanager.services.evaluations import eval_job_create
from tests.datamanager.factories import make_running_run
from workers.evaluation import eval_job_run

pytestmark = [pytest.mark.django_db, pytest.mark.browser, pytest.mark.slow]

ORACLE_TASKS = ["click-test", "click-button", "focus-text", "click-link"]


@pytest.fixture
def miniwob_tasks():
    return [
        Task.objects.create(
            name=f"miniwob/{n}",
            env_kind="miniwob",
            split="eval",
            env_config={"task": n, "episode_seconds": 60},
        )
        for n in ORACLE_TASKS
    ]


def test_oracle_scores_100_percent_through_the_same_path(miniwob_tasks, tmp_path):
    out = tmp_path / "oracle"
    call_command("evaluate", policy="oracle", tasks="split:eval", k=2, out=out)
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["summary"]["success_rate"] == 1.0 and report["summary"]["episodes"] == 8
    assert {r["task"] for r in report["tasks"]} == {f"miniwob/{n}" for n in ORACLE_TASKS}
    assert out.with_suffix(".csv").read_text().startswith("task,episodes,successes")
    # Stored like any trajectory, marked as evaluation, inspectable step by step.
    trajs = Trajectory.objects.filter(purpose="eval")
    assert trajs.count() == 8 and all(t.length >= 1 for t in trajs)


def test_evaluation_never_feeds_training_or_task_stats(miniwob_tasks):
    for t in miniwob_tasks:
        t.split = "train"
        t.save()
    run = make_running_run({"policy": "oracle", "trainer": {"min_groups": 1}})
    job = eval_job_create(
        name="in-run", policy="oracle", tasks=miniwob_tasks[:2], k=2, run_id=run.pk
    )
    eval_job_run(job_id=job.pk)
    assert Trajectory.objects.filter(run=run, purpose="eval", status="succeeded").count() == 4
    assert all(s.attempts == 0 for s in TaskStat.objects.filter(run=run))
    assert batches.batch_collect(run=run, current_version=0, min_groups=1) is None


def test_untrained_policy_is_evaluated_through_its_inference_server(
    miniwob_tasks, tiny_policy_dir, tmp_path
):
    out = tmp_path / "tiny"
    call_command("evaluate", policy=str(tiny_policy_dir), tasks="miniwob/click-test", k=1, out=out)
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["summary"]["episodes"] == 1 and report["greedy"] is True
    step = Trajectory.objects.get(eval_job_id=report["job"]).steps.first()
    assert step.policy_version == 0 and step.rollout_logprobs and step.raw_output


def test_a_bad_policy_or_task_selection_fails_with_a_reason(miniwob_tasks):
    with pytest.raises(CommandError, match="no Hugging Face checkpoint"):
        call_command("evaluate", policy="/nonexistent/ckpt", tasks="split:eval", k=1)
    with pytest.raises(CommandError, match="unknown task"):
        call_command("evaluate", policy="oracle", tasks="miniwob/nope", k=1)
    assert not EvalJob.objects.exists()


def test_a_stopping_worker_leaves_an_evaluation_between_episodes_and_it_resumes(miniwob_tasks):
    """Ctrl-C during an evaluation: the worker leaves after the episode under way (it is not
    killed mid-way at the launcher's deadline); the job resumes where it stopped."""
    from workers.lifecycle import shutdown_requested

    job = eval_job_create(name="stopped", policy="oracle", tasks=miniwob_tasks[:2], k=2)
    try:
        stopped = eval_job_run(job_id=job.pk, on_episode=shutdown_requested.set)
    finally:
        shutdown_requested.clear()
    assert (stopped.status, stopped.done) == ("running", 1)
    resumed = eval_job_run(job_id=job.pk)
    assert (resumed.status, resumed.done) == ("finished", 4)
    assert Trajectory.objects.filter(eval_job=job).count() == 4  # none run twice
