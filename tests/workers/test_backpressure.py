"""Backpressure: a slot holds new training claims while the trainer's backlog of ready,
untrained steps fills `curation.backpressure` updates, says so on its tile and the run page,
and claims again once an update consumed the backlog. Driven through a real slot worker on
the sim backend with the oracle policy; the trainer's side is the data manager's own
`batch_collect` and `batch_commit` (what an update reads and writes)."""

from __future__ import annotations

import threading
import time

import pytest

from datamanager.models import GroupStatus, SlotStatus, Step, TaskGroup, Trajectory

pytestmark = pytest.mark.django_db(transaction=True)


def _until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _sim_run(backpressure: float):
    from datamanager.models import Task
    from tests.datamanager.factories import make_running_run

    for name in ("sim/a", "sim/b"):
        Task.objects.get_or_create(name=name, env_kind="sim", env_config={"targets": 2})
    return make_running_run({
        "policy": "oracle",
        "tasks": {"env_kinds": ["sim"], "instances": 1},
        "env": {"miniwob_slots": 0, "sim_slots": 1},
        "curation": {"n_max": 2, "dynamic_budget": False, "backpressure": backpressure},
        "trainer": {"max_steps_per_update": 6, "min_groups": 1},
    })  # fmt: skip


@pytest.mark.slow  # a real slot worker serving for a few seconds
def test_a_slot_holds_while_the_trainer_is_behind_and_claims_again_after_an_update(
    settings, ada_client, live_work_keys_cleared
):
    from core.samples import UpdateMetrics
    from datamanager.selectors.flow import training_backlog
    from datamanager.services.batches import batch_collect, batch_commit
    from workers import slot_worker

    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    run = _sim_run(backpressure=1.0)  # hold at 6 ready steps
    cfg = run.cfg
    served = threading.Thread(
        target=slot_worker.serve_slice,
        kwargs={"run_id": run.pk, "backend": "sim", "index": 0, "max_seconds": 8.0},
    )
    served.start()
    try:
        slot = _until(lambda: _held_slot(run), 6.0, "the slot to hold its claims")
        backlog = training_backlog(run_id=run.pk, cfg=cfg)
        assert backlog.held and backlog.limit == 6
        # Held, it collects nothing more: the count stays while the trainer does nothing.
        trajectories = Trajectory.objects.filter(run=run).count()
        time.sleep(1.5)
        assert Trajectory.objects.filter(run=run).count() == trajectories
        slot.refresh_from_db()
        assert slot.status == SlotStatus.HELD
        page = ada_client.get(f"/runs/{run.pk}/").content.decode()
        assert (f"1 slot held: trainer behind by {backlog.waiting} steps (holding new "
                "training claims at 6: curation.backpressure).") in page  # fmt: skip
        wall = ada_client.get(f"/runs/{run.pk}/slots.json").json()["slots"]
        assert [t["status"] for t in wall] == ["held"]

        # An update takes the ready groups: the slot claims again.
        batch = batch_collect(run=run, current_version=0, min_groups=1)
        assert batch is not None and batch.samples
        batch_commit(run=run, batch=batch, metrics=UpdateMetrics(), trained_version=0)
        _until(
            lambda: Trajectory.objects.filter(run=run).count() > trajectories,
            6.0,
            "a new claim after the update",
        )
    finally:
        served.join()
    assert TaskGroup.objects.filter(run=run, status=GroupStatus.TRAINED).exists()


def _held_slot(run):
    from datamanager.models import EnvSlot

    return EnvSlot.objects.filter(run=run, status=SlotStatus.HELD).first()


@pytest.mark.slow  # two real slot workers, two seconds each (longer on a loaded machine)
def test_without_backpressure_the_slot_runs_ahead_of_the_trainer(settings, live_work_keys_cleared):
    from workers import slot_worker

    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    held, free = _sim_run(backpressure=1.0), _sim_run(backpressure=0.0)

    def ready_steps(run) -> int:
        return Step.objects.filter(
            trajectory__group__run=run, trajectory__group__status=GroupStatus.READY
        ).count()

    def serve(run, seconds: float) -> None:
        slot_worker.serve_slice(run_id=run.pk, backend="sim", index=0, max_seconds=seconds)

    # The free run serves until its backlog is three times the held run's (on a loaded
    # machine that takes longer than 2 s), and the held run then as long again: held at 6
    # ready steps however long it serves (one more group may finish while the limit is
    # crossed), the free run's backlog grows for as long as it serves.
    serve(held, 2.0)
    seconds = 0.0
    while seconds < 30.0 and (not seconds or ready_steps(free) <= 3 * ready_steps(held)):
        serve(free, 2.0)
        seconds += 2.0
    if seconds > 2.0:
        serve(held, seconds - 2.0)
    assert 6 <= ready_steps(held) <= 6 + 2 * 2 * 2
    assert ready_steps(free) > 3 * ready_steps(held)
