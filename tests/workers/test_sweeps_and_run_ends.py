"""A run ends when its trainer reached max_updates and its evaluations ended; a sweep starts
its members `parallel` at a time as earlier ones end, passing over one that cannot start;
an evaluation starts on a running run's slots on request, one at a time."""

from __future__ import annotations

import pytest

from datamanager.config import RunConfig
from datamanager.models import (
    EvalJob,
    EvalScope,
    EvalStatus,
    Run,
    RunAction,
    RunStatus,
    Task,
    TrainUpdate,
)
from datamanager.services.evaluations import EvalNotStartable, eval_start, run_finish_if_done
from datamanager.services.runs import NotYourRun, run_control, run_create, run_finish
from datamanager.services.sweeps import sweep_advance, sweep_create

pytestmark = pytest.mark.django_db

ORACLE = {"policy": "oracle", "env": {"miniwob_slots": 1}}


@pytest.fixture(autouse=True)
def tasks():
    Task.objects.create(name="click-button", env_kind="miniwob")
    Task.objects.create(name="click-eval", env_kind="miniwob", split="eval")


def running(**cfg) -> Run:
    run = run_create(name="r", config=RunConfig.from_dict({**ORACLE, **cfg}))
    return run_control(run_id=run.pk, action="start")


def test_a_run_finishes_at_max_updates_once_its_evaluations_ended(live_work_keys_cleared):
    run = running(trainer={"max_updates": 2}, evaluation={"every_n_versions": 1})
    TrainUpdate.objects.create(run=run, number=1, policy_version=0)
    assert not run_finish_if_done(run_id=run.pk)  # one update of two
    TrainUpdate.objects.create(run=run, number=2, policy_version=1)
    assert not run_finish_if_done(run_id=run.pk)  # the starting policy's evaluation is due
    job = EvalJob.objects.get(run=run)
    assert (job.policy_version, job.scope) == (0, EvalScope.EVAL_SPLIT)
    assert Run.objects.get(pk=run.pk).status == RunStatus.RUNNING
    EvalJob.objects.filter(pk=job.pk).update(status=EvalStatus.FINISHED)
    assert run_finish_if_done(run_id=run.pk)
    run.refresh_from_db()
    assert run.status == RunStatus.FINISHED and run.finished_at is not None
    assert run.status_message == "finished: 2 updates (trainer.max_updates) and their evaluations"


def test_a_run_without_max_updates_never_finishes_on_its_own():
    run = running()
    TrainUpdate.objects.create(run=run, number=1, policy_version=0)
    assert not run_finish_if_done(run_id=run.pk)


def test_a_sweep_starts_the_next_member_as_one_ends_and_passes_over_one_that_cannot_start(
    django_user_model, live_work_keys_cleared
):
    ada = django_user_model.objects.create_user("ada")
    sweep = sweep_create(
        name="s", config=ORACLE, grid={"seed": [1, 2, 3, 4]}, parallel=2, owner=ada
    )
    runs = [m.run for m in sweep.members.order_by("index")]
    assert sweep_advance(sweep_id=sweep.pk) == [runs[0].pk, runs[1].pk]
    assert sweep_advance(sweep_id=sweep.pk) == []  # two at a time
    # The third cannot start (its task is gone); the fourth starts in its place.
    Run.objects.filter(pk=runs[2].pk).update(
        config={**runs[2].config, "tasks": {**runs[2].config["tasks"], "names": ["gone"]}}
    )
    run_finish(run_id=runs[0].pk, message="done")
    assert sweep_advance(sweep_id=sweep.pk) == [runs[3].pk]
    third = Run.objects.get(pk=runs[2].pk)
    assert third.status == RunStatus.CREATED
    assert third.status_message.startswith("the sweep could not start it: ")
    assert RunAction.objects.get(run=third).outcome.startswith("refused: ")
    assert Run.objects.get(pk=runs[3].pk).owner == ada


def test_an_evaluation_starts_on_request_on_a_running_runs_slots_one_at_a_time(
    django_user_model, live_work_keys_cleared
):
    ada, bob = (django_user_model.objects.create_user(n) for n in ("ada", "bob"))
    run = run_create(name="r", config=RunConfig.from_dict(ORACLE), owner=ada)
    with pytest.raises(
        EvalNotStartable, match="is created: its env slots evaluate only while it runs"
    ):
        eval_start(run_id=run.pk, scope="eval_split", version=None, user=ada)
    run_control(run_id=run.pk, action="start")
    with pytest.raises(NotYourRun):
        eval_start(run_id=run.pk, scope="eval_split", version=None, user=bob)
    with pytest.raises(EvalNotStartable, match="has no held-out seeds"):
        eval_start(run_id=run.pk, scope="heldout", version=None, user=ada)
    job = eval_start(run_id=run.pk, scope="eval_split", version=None, user=ada)
    assert (job.policy_version, job.task_names, job.owner, job.shards) == (
        0,
        ["click-eval"],
        ada,
        1,
    )
    with pytest.raises(
        EvalNotStartable, match=f"evaluation #{job.pk} of run #{run.pk} is under way"
    ):
        eval_start(run_id=run.pk, scope="eval_split", version=None, user=ada)
