"""Evaluation through the training path: the oracle loses nothing, a model is evaluated via
its own inference server, and evaluation data never feeds training or curation."""

import json

import pytest
from django.core.management import CommandError, call_command

from datamanager.config import RunConfig
from datamanager.models import EvalJob, PolicyVersion, Task, TaskStat, Trajectory
from datamanager.policies import policy_path
from datamanager.services import batches
from datamanager.services.evaluations import eval_job_create
from datamanager.services.runs import run_create
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
    # A shard delivered again after the job finished (a restart) finds nothing to run: the
    # job never shows as running again, and keeps its finish time.
    again = eval_job_run(job_id=job.pk)
    assert (again.status, again.finished_at) == ("finished", resumed.finished_at)
    assert Trajectory.objects.filter(eval_job=job).count() == 4


def test_a_checkpoint_of_another_model_is_scored_under_a_run_or_refused(miniwob_tasks, tmp_path):
    """A UI-TARS / Qwen2.5-VL checkpoint under Dartboard's own prompt would be scored on a
    format it was never taught: evaluate asks for the run whose prompt and budgets apply."""
    other = tmp_path / "qwen25"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    with pytest.raises(CommandError, match=r"qwen2_5_vl checkpoint: without a run .* --run ID"):
        call_command("evaluate", policy=str(other), tasks="miniwob/click-test", k=1)
    with pytest.raises(CommandError, match="--run 999: no such run"):
        call_command("evaluate", policy=str(other), run=999, tasks="miniwob/click-test", k=1)
    with pytest.raises(CommandError, match="has published no version yet"):
        run = run_create(name="ui-tars", config=RunConfig())
        call_command("evaluate", run=run.pk, tasks="miniwob/click-test", k=1)
    assert not EvalJob.objects.exists()


def test_a_run_version_is_scored_under_its_run(miniwob_tasks, tmp_path):
    run = run_create(name="r", config=RunConfig.from_dict({"rollout": {"max_new_tokens": 48}}))
    PolicyVersion.objects.create(run=run, version=3, checkpoint=str(policy_path("shipped")))
    out = tmp_path / "r"
    call_command("evaluate", run=run.pk, tasks="miniwob/click-test", k=1, out=out)
    job = EvalJob.objects.get()
    assert (job.policy, job.run_id) == (f"run:{run.pk}:v3", run.pk)
