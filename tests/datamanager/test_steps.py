"""Recording many trajectories' steps in one transaction (datamanager/services/steps.py)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from datamanager.models import Step, Trajectory
from datamanager.services.episodes import task_claim, trajectory_head
from datamanager.services.steps import StepWrite, steps_store_many
from rollout.episode import StepRecord
from tests.conftest import png_bytes
from tests.datamanager.factories import make_running_run, make_tasks

pytestmark = pytest.mark.django_db


def _write(head, index: int, version: int | None = 0) -> StepWrite:
    return StepWrite(head=head, record=StepRecord(
        index=index, screenshot_png=png_bytes(), width=160, height=210,
        raw_output=f"Action: click(start_box='({index},{index})')", thought="", action={
            "type": "click", "x": index, "y": index}, parse_error="", prompt_tokens=10,
        response_tokens=5, rollout_logprobs=[-0.1], response_token_ids=[1, 2],
        mean_entropy=0.5, policy_version=version, env_ms=3.0, model_ms=4.0,
    ))  # fmt: skip


def _heads(n: int):
    make_tasks(2)
    run = make_running_run({"curation": {"n_max": 4}})
    claims = [task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)) for _ in range(n)]
    return [trajectory_head(trajectory_id=c.trajectory_id) for c in claims]


def test_steps_of_three_trajectories_in_one_transaction() -> None:
    a, b, c = _heads(3)
    with CaptureQueriesContext(connection) as queries:
        assert steps_store_many(writes=[_write(a, 0), _write(b, 0), _write(c, 0, version=2)]) == 3
    statements = [q["sql"] for q in queries if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))]
    assert len(statements) == 2  # one INSERT of the three rows, one UPDATE of the lengths
    steps_store_many(writes=[_write(a, 1, version=1), _write(b, 1)])
    assert [Trajectory.objects.get(pk=h.pk).length for h in (a, b, c)] == [2, 2, 1]
    assert Trajectory.objects.get(pk=a.pk).policy_versions == [0, 1]
    assert Trajectory.objects.get(pk=c.pk).policy_versions == [2]
    step = Step.objects.get(trajectory_id=a.pk, index=1)
    assert step.action == {"type": "click", "x": 1, "y": 1} and step.response_token_ids == [1, 2]
    assert step.screenshot.read() == png_bytes()


def test_a_retried_batch_stores_each_step_once() -> None:
    a, b = _heads(2)
    steps_store_many(writes=[_write(a, 0)])  # the first try got a's step in, then failed
    assert steps_store_many(writes=[_write(a, 0), _write(b, 0)], resume=True) == 1
    assert Step.objects.filter(trajectory_id__in=[a.pk, b.pk]).count() == 2
    assert [Trajectory.objects.get(pk=h.pk).length for h in (a, b)] == [1, 1]
