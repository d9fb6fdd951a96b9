"""Health signals on the run page: the trainer-vs-rollout log-prob gap per update, charted
against its threshold, and an alert once an update crosses it (a worker serving other
weights than the version it reports: tests/training/test_update.py shows the gap it makes);
and an alert for an episode still sampled from a long superseded version."""

from __future__ import annotations

import re

import pytest

from datamanager.models import PolicyVersion, TrainUpdate
from datamanager.services import episodes
from tests.conftest import png_bytes
from tests.datamanager.factories import make_running_run, make_tasks, step_record

pytestmark = pytest.mark.django_db


def _update(run, number: int, gap: float, tokens: int = 120) -> None:
    TrainUpdate.objects.create(
        run=run, number=number, policy_version=number - 1,
        metrics={"loss": 0.1, "logprob_gap_mean": gap, "logprob_gap_p99": gap * 4,
                 "logprob_gap_tokens": tokens},
    )  # fmt: skip


def test_the_gap_is_charted_with_its_threshold_and_alerts_once_crossed(ada_client):
    make_tasks(1)
    run = make_running_run({"trainer": {"logprob_gap_alert": 0.05}})
    _update(run, 1, 0.0004)
    _update(run, 2, 0.0006)
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "Log-prob gap" not in page  # numerical noise: no alert

    _update(run, 3, 0.31)
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert 'role="alert">Log-prob gap: update 3 measured 0.310 nats per token (p99 1.240)' in page
    assert "over the alert threshold 0.05" in page and "sampled from version 2" in page

    figure = ada_client.get(f"/runs/{run.pk}/charts.json").json()["logprob_gap"]
    lines = {trace["name"]: trace for trace in figure["data"]}
    assert lines["mean per token"]["y"] == [0.0004, 0.0006, 0.31]
    assert lines["p99 per token"]["y"] == [0.0016, 0.0024, 1.24]
    assert lines["alert threshold (mean)"]["y"] == [0.05, 0.05]


def test_an_update_that_measured_nothing_or_a_threshold_of_zero_raises_no_alert(ada_client):
    make_tasks(1)
    run = make_running_run({"trainer": {"logprob_gap_alert": 0.0}})
    _update(run, 1, 0.9)
    assert "Log-prob gap" not in ada_client.get(f"/runs/{run.pk}/").content.decode()
    other = make_running_run({})
    _update(other, 1, 0.9, tokens=0)  # no fresh steps in that update: nothing measured
    assert "Log-prob gap" not in ada_client.get(f"/runs/{other.pk}/").content.decode()


def _running_episode(run, *, version: int) -> int:
    """An episode under way whose newest step was sampled from `version`."""
    claim = episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
    assert claim is not None
    step_record(
        trajectory_id=claim.trajectory_id, index=0, screenshot_png=png_bytes(), width=160,
        height=210, raw_output="Action: wait()", thought="", action={"type": "wait"},
        parse_error="", prompt_tokens=10, response_tokens=3, rollout_logprobs=[],
        mean_entropy=0.5, policy_version=version, env_ms=1.0, model_ms=1.0,
    )  # fmt: skip
    return claim.trajectory_id


def test_an_episode_still_sampled_from_a_long_superseded_version_raises_an_alert(ada_client):
    make_tasks(2)
    run = make_running_run({"trainer": {"stale_serving_alert": 3}, "curation": {"n_min": 2}})
    for version in range(6):
        PolicyVersion.objects.create(run=run, version=version, checkpoint=f"/ckpt/v{version}")
    _running_episode(run, version=4)  # one behind: the rolling sync has not reached it yet
    assert "Stale weights served" not in ada_client.get(f"/runs/{run.pk}/").content.decode()

    stuck = _running_episode(run, version=1)  # four behind: a worker the sync never reached
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert f"Stale weights served: trajectory {stuck} on an unknown slot" in page
    assert "from version 1, 4 versions behind the newest (v5); 1 episode(s)" in page


def _ended(run, slot, *, status: str, error: str = "", reset_ms: float = 0.0) -> int:
    claim = episodes.task_claim(run_id=run.pk, slot_id=slot.pk, env_kinds=("miniwob",))
    assert claim is not None
    details = {"end_reason": "step_cap", "reset_ms": reset_ms} if status != "error" else {}
    episodes.trajectory_finish(
        trajectory_id=claim.trajectory_id, status=status,
        reward=None if status == "error" else float(status == "succeeded"),
        error=error, details=details,
    )  # fmt: skip
    return claim.trajectory_id


def test_env_errors_per_host_and_task_are_charted_mapped_and_alerted(ada_client):
    from datamanager.models import EnvSlot

    make_tasks(2)
    run = make_running_run({"env": {"error_rate_alert": 0.3, "miniwob_slots": 2},
                            "curation": {"n_max": 8, "n_min": 8}})  # fmt: skip
    sick = EnvSlot.objects.create(name="vm-7:1:miniwob:0", host="vm-7", backend="miniwob", run=run)
    well = EnvSlot.objects.create(name="vm-2:1:miniwob:1", host="vm-2", backend="miniwob", run=run)
    for _ in range(3):
        _ended(run, well, status="succeeded", reset_ms=120.0)
        _ended(run, well, status="failed", reset_ms=140.0)
        _ended(run, sick, status="error", error="EnvUnavailable: reset timed out after 30 s")
    _ended(run, sick, status="failed", reset_ms=9000.0)
    _ended(run, sick, status="error", error="inference: the router did not answer")  # not the env's
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert ('role="alert">Environment errors on host vm-7: 3 of 5 rollouts (60%) in the last 15 '
            "minutes ended in an environment error, over the alert threshold 30%") in page  # fmt: skip
    assert "Environment errors on host vm-2" not in page
    sick_tile = re.search(r'<div class="host (\w+)" data-host="vm-7".*?</div>', page, re.S)
    assert sick_tile.group(1) == "degraded"
    assert "3 env errors</a> of 5 rollouts (60.0%)" in sick_tile.group(0)
    assert "reset 9000 ms" in sick_tile.group(0)
    well_tile = re.search(r'<div class="host (\w+)" data-host="vm-2".*?</div>', page, re.S)
    assert well_tile.group(1) == "ok" and "reset 130 ms" in well_tile.group(0)

    figs = ada_client.get(f"/runs/{run.pk}/charts.json").json()
    hosts = {t["name"]: t for t in figs["errors_host"]["data"]}
    assert hosts["vm-7"]["y"] == [0.6] and hosts["vm-2"]["y"] == [0.0]
    assert (
        "env_error=yes" in hosts["vm-7"]["customdata"][0]
        and "host=vm-7" in hosts["vm-7"]["customdata"][0]
    )
    tasks = {t["name"]: t["y"][0] for t in figs["errors_task"]["data"]}
    assert sum(tasks.values()) > 0 and set(tasks) == {"miniwob/t0", "miniwob/t1"}


def test_the_share_left_out_of_training_is_charted_and_alerted(ada_client):
    from datamanager.models import EnvSlot, Trajectory

    make_tasks(1)
    run = make_running_run(
        {"trainer": {"left_out_alert": 0.4}, "curation": {"n_max": 8, "n_min": 8}}
    )
    slot = EnvSlot.objects.create(name="h:1:miniwob:0", host="h", backend="miniwob", run=run)
    kept = [_ended(run, slot, status="failed") for _ in range(3)]
    _ended(run, slot, status="error", error="EnvUnavailable: x")
    _ended(run, slot, status="aborted", error="worker lost")
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "Left out of training" not in page  # 2 of 5: under 40%
    Trajectory.objects.filter(pk=kept[0]).update(rejected=True)
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert 'role="alert">Left out of training: 3 of 5 rollouts (60%) in the last 15 minutes' in page
    TrainUpdate.objects.create(run=run, number=1, policy_version=0,
                               metrics={"kind": "rl", "stale_steps": 30, "n_samples": 10})  # fmt: skip
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "Stale steps left out: update 1 left out 30 of 40 collected steps (75%)" in page
    assert "(set curation.backpressure, e.g. 2, so slots hold while" in page
    run.config = {**run.config, "curation": {**run.config["curation"], "backpressure": 2}}
    run.save(update_fields=["config"])
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "(slots hold at curation.backpressure 2 updates: lower it, or add" in page
    figure = ada_client.get(f"/runs/{run.pk}/charts.json").json()["left_out"]
    lines = {t["name"]: t["y"] for t in figure["data"]}
    assert lines["rollouts: error, aborted or rejected"] == [0.6]
    assert lines["steps: too stale (per update)"] == [0.75]


def test_the_host_map_shows_each_hosts_disk_from_its_workers_heartbeats(ada_client):
    from datamanager.models import EnvSlot
    from datamanager.services.env_slots import env_slot_heartbeat
    from workers.disk import home_disk

    make_tasks(1)
    run = make_running_run({"env": {"miniwob_slots": 2}})
    here = EnvSlot.objects.create(name="vm-1:1:miniwob:0", host="vm-1", backend="miniwob", run=run)
    full = EnvSlot.objects.create(name="vm-9:1:miniwob:1", host="vm-9", backend="miniwob", run=run)
    free, total = home_disk()  # this machine's, as a slot worker's heartbeat sends it
    assert 0 < free <= total
    env_slot_heartbeat(slot_id=here.pk, disk=(free, total))
    env_slot_heartbeat(slot_id=full.pk, disk=(300 * 2**20, 50 * 2**30))
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    tile = re.search(r'<div class="host \w+" data-host="vm-1".*?</div>', page, re.S).group(0)
    assert f"disk: {free / 2**30:,.1f} GB free of {total / 2**30:,.1f} GB" in tile
    tile = re.search(r'<div class="host \w+" data-host="vm-9".*?</div>', page, re.S).group(0)
    assert '<span class="disk badge failed"' in tile and "disk: 0.3 GB free of 50.0 GB" in tile
