"""Storing steps (datamanager/services/steps.py): one step in two statements, many in one
transaction, a retry stores each step once, a failure leaves no file behind."""

from __future__ import annotations

import os

import pytest
from django.core.files.storage import default_storage
from django.db import connection
from django.test.utils import CaptureQueriesContext

from core.steps import StepRecord, pack_token_ids, unpack_token_ids
from datamanager.models import Step, Trajectory
from datamanager.selectors.steps import step_record
from datamanager.services.episodes import task_claim
from datamanager.services.steps import StepWrite, steps_store, trajectory_head
from tests.conftest import png_bytes
from tests.datamanager.factories import make_running_run, make_tasks

pytestmark = pytest.mark.django_db


def _record(index: int, version: int | None = 0, ids: list[int] | None = None) -> StepRecord:
    return StepRecord(
        index=index,
        screenshot_png=png_bytes(),
        width=160,
        height=210,
        raw_output=f"Action: click(start_box='({index},{index})')",
        thought="",
        action={"type": "click", "x": index, "y": index},
        parse_error="",
        prompt_tokens=10,
        response_tokens=5,
        rollout_logprobs=[-0.1],
        response_token_ids=[1, 2],
        mean_entropy=0.5,
        policy_version=version,
        env_ms=3.0,
        model_ms=4.0,
        prompt_token_ids=ids or [],
    )


def _write(head, index: int, version: int | None = 0) -> StepWrite:
    return StepWrite(head=head, record=_record(index, version))


def _heads(n: int):
    make_tasks(2)
    run = make_running_run({"curation": {"n_max": 4}})
    claims = [task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)) for _ in range(n)]
    return [trajectory_head(trajectory_id=c.trajectory_id) for c in claims]


def _statements(queries) -> list[str]:
    return [q["sql"] for q in queries if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))]


def test_one_step_is_two_statements_and_keeps_its_prompt_ids() -> None:
    [head] = _heads(1)
    ids = [151644, 8948, *[151655] * 300, 198, 77091]
    with CaptureQueriesContext(connection) as queries:
        [step] = steps_store(writes=[StepWrite(head=head, record=_record(0, ids=ids))])
    assert len(_statements(queries)) == 2  # the row, the trajectory's length
    step.refresh_from_db()
    assert unpack_token_ids(step.prompt_token_ids) == ids
    assert len(step.prompt_token_ids) < 100  # the run of image pads packs to little
    assert step_record(step, screenshot_png=b"").prompt_token_ids == ids


def test_steps_of_three_trajectories_in_one_transaction() -> None:
    a, b, c = _heads(3)
    with CaptureQueriesContext(connection) as queries:
        writes = [_write(a, 0), _write(b, 0), _write(c, 0, version=2)]
        assert len(steps_store(writes=writes)) == 3
    assert len(_statements(queries)) == 2  # one INSERT of the three rows, one UPDATE of lengths
    steps_store(writes=[_write(a, 1, version=1), _write(b, 1)])
    assert [Trajectory.objects.get(pk=h.pk).length for h in (a, b, c)] == [2, 2, 1]
    assert Trajectory.objects.get(pk=a.pk).policy_versions == [0, 1]
    assert Trajectory.objects.get(pk=c.pk).policy_versions == [2]
    step = Step.objects.get(trajectory_id=a.pk, index=1)
    assert step.action == {"type": "click", "x": 1, "y": 1} and step.response_token_ids == [1, 2]
    assert step.screenshot.read() == png_bytes()


def test_a_retried_batch_stores_each_step_once() -> None:
    a, b = _heads(2)
    [first] = steps_store(writes=[_write(a, 0)])  # the first try got a's step in, then failed
    again = steps_store(writes=[_write(a, 0), _write(b, 0)], resume=True)
    assert again[0].pk == first.pk
    assert Step.objects.filter(trajectory_id__in=[a.pk, b.pk]).count() == 2
    assert [Trajectory.objects.get(pk=h.pk).length for h in (a, b)] == [1, 1]


def test_a_failed_store_leaves_no_screenshot_without_its_row() -> None:
    """The second step collides with a stored one (same index): the transaction fails and
    the files it wrote go with it."""
    a, b = _heads(2)
    [stored] = steps_store(writes=[_write(a, 0)])
    a_dir = os.path.dirname(stored.screenshot.name)
    b_dir = a_dir.replace(a.media_dir, b.media_dir)
    before = {
        d: default_storage.listdir(d)[1] if default_storage.exists(d) else []
        for d in (a_dir, b_dir)
    }
    with pytest.raises(Exception, match=r"(?i)unique"):
        steps_store(writes=[_write(b, 0), _write(a, 0)])
    assert not Step.objects.filter(trajectory_id=b.pk).exists()
    after = {
        d: default_storage.listdir(d)[1] if default_storage.exists(d) else []
        for d in (a_dir, b_dir)
    }
    assert after == before


def test_token_ids_pack_and_unpack() -> None:
    ids = [0, 1, 2**32 - 1, *range(1000)]
    assert unpack_token_ids(pack_token_ids(ids)) == ids
    assert pack_token_ids([]) == b"" and unpack_token_ids(b"") == []
