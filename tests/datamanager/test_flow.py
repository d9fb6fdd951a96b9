"""Where collected steps go (datamanager.selectors.flow): each online step counted once as
trained, left out by the entropy selection, left out as stale, lost with its episode, or
waiting; the run page says it, and evaluation episodes and demonstrations are not counted."""

from __future__ import annotations

import pytest

from core.samples import UpdateMetrics
from datamanager.models import Trajectory
from datamanager.selectors.flow import step_flow
from datamanager.services.batches import batch_collect, batch_commit
from tests.datamanager.factories import make_running_run, make_tasks, play

pytestmark = pytest.mark.django_db


def test_each_collected_step_has_one_fate_and_the_page_says_them(ada_client):
    make_tasks(1)
    run = make_running_run({"curation": {"n_max": 2, "dynamic_budget": False},
                            "trainer": {"min_groups": 1}})  # fmt: skip
    # Group 1 (2 rollouts x 3 steps) is trained: one step left out by the entropy filter.
    for ok in (True, False):
        play(run, success=ok, steps=3)
    batch = batch_collect(run=run, current_version=0, min_groups=1)
    assert batch is not None
    steps = sorted(s.step_id for s in batch.samples)
    assert len(steps) == 6
    metrics = UpdateMetrics(step_entropy_kept={pk: pk != steps[0] for pk in steps})
    batch_commit(run=run, batch=batch, metrics=metrics, trained_version=0)
    # Group 2 was sampled by version 0 and reaches the trainer at version 3: stale (k = 2).
    play(run, success=True, steps=2, version=0)
    play(run, success=False, steps=2, version=0)
    batch = batch_collect(run=run, current_version=3, min_groups=1)
    assert batch is not None and len(batch.stale_step_ids) == 4
    batch_commit(run=run, batch=batch, metrics=UpdateMetrics(), trained_version=3)
    # Group 3 waits for the trainer; group 4's first episode ended in an environment error:
    # its step is lost with it.
    play(run, success=True, steps=1)
    play(run, success=False, steps=1)
    lost = play(run, success=False, steps=1)
    Trajectory.objects.filter(pk=lost).update(status="error")

    flow = step_flow(run=run)
    assert (flow.collected, flow.trained, flow.entropy, flow.stale, flow.lost, flow.waiting) == (
        13,
        5,
        1,
        4,
        1,
        2,
    )
    assert flow.share("stale") == pytest.approx(4 / 11)
    assert flow.chosen_share == pytest.approx(6 / 11)
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert ("Collected steps: 13; of the 11 settled, 5 trained (45%), 1 left out by the entropy "
            "selection (9%), 4 as stale (36%), 1 with their episode (error, abort, rejection: "
            "9%); 2 waiting.") in page  # fmt: skip
