"""A live stale-weights fault: an inference worker keeps serving the old weights while it
claims the new version (TRL issue 5312's silent failure). Real episodes on the slot path
(the `sim` backend, in this process) against real transformers inference servers, and real
updates of the tiny policy: the honest round's log-prob gap is numerical noise, the faulty
round's crosses the alert threshold, and the run page raises the alert.

The untrained policy rarely clicks a target, so an admin's audited reward override gives
each group a spread of rewards (a group without one trains nothing, and the gap is measured
on the steps an update trains)."""

from __future__ import annotations

import pytest

from datamanager.models import PolicyVersion, Task, TrainUpdate, Trajectory
from datamanager.services import review
from rollout.local_server import LocalPolicyServer
from tests.datamanager.factories import make_running_run
from workers import slot_worker, training_loop

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
THRESHOLD = 0.1  # the default: measured here, honest 2e-7 nats per token, stale 0.36


def _round(run, url: str, settings, admin) -> None:
    """Four episodes (one group) served by the server at `url`; half re-rewarded to 1."""
    settings.DARTBOARD_INFERENCE_URLS = [url]
    before = set(Trajectory.objects.filter(run=run).values_list("pk", flat=True))
    outcome = slot_worker.serve_slice(
        run_id=run.pk, backend="sim", index=0, max_seconds=180, max_episodes=4
    )
    assert outcome.reason == "4 episodes done", outcome
    fresh = Trajectory.objects.filter(run=run).exclude(pk__in=before).order_by("pk")
    assert [t.status for t in fresh] and all(t.status in ("succeeded", "failed") for t in fresh)
    for traj in fresh[:2]:
        review.trajectory_override_reward(
            trajectory_id=traj.pk, reward=1.0, reason="test: a spread of rewards", user=admin
        )


def _train(run, updates: int) -> TrainUpdate:
    run.config["trainer"]["max_updates"] = updates
    type(run).objects.filter(pk=run.pk).update(config=run.config)
    assert training_loop.train_for(run_id=run.pk, max_seconds=180) == "max_updates reached"
    # Reaching max_updates finishes the run: the next round raises it and runs on.
    type(run).objects.filter(pk=run.pk).update(status="running")
    return TrainUpdate.objects.get(run=run, number=updates)


def test_a_worker_serving_old_weights_as_the_new_version_raises_the_gap_alert(
    ada_client, researcher, tiny_policy_dir, settings, tmp_path
):
    settings.CHECKPOINT_ROOT = tmp_path / "checkpoints"
    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.001  # sim slots take an OSWorld VM's time, scaled
    Task.objects.create(name="sim/one", env_kind="sim", env_config={"targets": 1})
    run = make_running_run(
        {
            "policy": str(tiny_policy_dir),
            "tasks": {"env_kinds": ["sim"]},
            "env": {"miniwob_slots": 0, "sim_slots": 1},
            "rollout": {"max_new_tokens": 16},
            "curation": {"n_max": 4, "n_min": 4, "default_step_cap": 2, "entropy_top_q": 1.0},
            "trainer": {"min_groups": 1, "lr": 5e-3, "kl_coef": 0.0,
                        "logprob_gap_alert": THRESHOLD},
        }
    )  # fmt: skip
    training_loop.trainers_forget_all()

    with LocalPolicyServer(tiny_policy_dir, version=0) as honest:  # v0 weights, says v0
        _round(run, honest, settings, researcher)
    first = _train(run, 1)
    assert PolicyVersion.objects.filter(run=run, version=1).exists()
    assert first.metrics["logprob_gap_tokens"] > 0 and first.metrics["logprob_gap_mean"] < 0.01
    assert "Log-prob gap" not in ada_client.get(f"/runs/{run.pk}/").content.decode()

    with LocalPolicyServer(tiny_policy_dir, version=1) as stale:  # v0 weights, says v1
        _round(run, stale, settings, researcher)
    second = _train(run, 2)
    gap = second.metrics["logprob_gap_mean"]
    assert second.metrics["logprob_gap_tokens"] > 0 and gap > THRESHOLD

    figure = ada_client.get(f"/runs/{run.pk}/charts.json").json()["logprob_gap"]
    lines = {trace["name"]: trace for trace in figure["data"]}
    assert lines["mean per token"]["y"][0] < THRESHOLD < lines["mean per token"]["y"][1]
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert f'role="alert">Log-prob gap: update 2 measured {gap:.3f} nats per token' in page
    assert "sampled from version 1, over the alert threshold 0.1" in page
