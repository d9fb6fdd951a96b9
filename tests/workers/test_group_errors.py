"""A group never trains with a member silently missing: a member that ends in an
environment error is replaced by a new rollout on a fresh environment (up to
`curation.error_retries`), and a group still missing one is dropped with the error. Driven
through a real slot worker on a flaky sim environment (its first resets at a seed crash)."""

from __future__ import annotations

import pytest

from datamanager.models import GroupStatus, TaskGroup, Trajectory
from envmanager import sim_env

pytestmark = pytest.mark.django_db


@pytest.mark.slow  # a real slot worker serving for 2 s
def test_a_crashed_member_is_replaced_and_a_group_still_missing_one_is_dropped(
    settings, monkeypatch, live_work_keys_cleared
):
    from datamanager.models import Task
    from tests.datamanager.factories import make_running_run
    from workers import slot_worker

    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    monkeypatch.setattr(sim_env, "_CRASHED", {})
    Task.objects.create(name="sim/once", env_kind="sim",
                        env_config={"targets": 1, "crash_first": 1})  # fmt: skip
    Task.objects.create(name="sim/twice", env_kind="sim",
                        env_config={"targets": 1, "crash_first": 2})  # fmt: skip
    run = make_running_run({
        "policy": "oracle",
        "tasks": {"env_kinds": ["sim"], "instances": 1},
        "env": {"miniwob_slots": 0, "sim_slots": 1},
        "curation": {"n_max": 2, "dynamic_budget": False, "error_retries": 1},
    })  # fmt: skip
    slot_worker.serve_slice(run_id=run.pk, backend="sim", index=0, max_seconds=2.0)

    def first_group(task: str) -> tuple[TaskGroup, list[str]]:
        group = TaskGroup.objects.get(run=run, task__name=task, index=1)
        return group, sorted(
            Trajectory.objects.filter(group=group).values_list("status", flat=True)
        )

    once, statuses = first_group("sim/once")
    assert statuses == ["error", "succeeded", "succeeded"]  # the crash was replaced
    assert (once.status, once.budget, once.retries) == (GroupStatus.READY, 3, 1)
    twice, statuses = first_group("sim/twice")
    assert statuses == ["error", "error", "succeeded"]  # one replacement, then out of retries
    assert twice.status == GroupStatus.SKIPPED
    assert twice.note.startswith(
        "dropped: 2 members ended in an environment error and 1 were replaced "
        "(curation.error_retries); trajectory #"
    )
    assert "sim: simulated crash 2 of 2" in twice.note
    later = TaskGroup.objects.filter(run=run, task__name="sim/twice", index__gt=1)
    assert later.exists() and later.first().status == GroupStatus.READY  # no more crashes
