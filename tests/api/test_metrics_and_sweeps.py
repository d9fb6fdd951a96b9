"""Metrics (JSON and CSV, the run page's numbers) and sweeps through the API on a live
server: a sweep makes its runs, starts them one at a time as earlier ones end, and lines up
their curves on its page and in its CSV."""

from __future__ import annotations

import csv
import io

import pytest

from datamanager.models import (
    EvalJob,
    EvalScope,
    EvalStatus,
    Purpose,
    Run,
    RunStatus,
    Sweep,
    Task,
    TrainUpdate,
    Trajectory,
)
from datamanager.services.runs import run_finish
from datamanager.services.sweeps import sweeps_advance
from tests.api.conftest import problem_of

ORACLE = {"policy": "oracle", "env": {"miniwob_slots": 1}}


@pytest.fixture(autouse=True)
def tasks(transactional_db):
    for name in ("click-button", "enter-text"):
        Task.objects.get_or_create(name=name, defaults={"env_kind": "miniwob", "instruction": name})


def greedy(run: Run, version: int, ok: int, n: int, scope=EvalScope.TRAIN_INSTANCES) -> None:
    """A finished scheduled evaluation of `version`: `ok` of `n` episodes succeeded."""
    job = EvalJob.objects.create(
        name=f"v{version}", policy="oracle", run=run, policy_version=version, scope=scope,
        status=EvalStatus.FINISHED, total=n, done=n,
    )  # fmt: skip
    task = Task.objects.get(name="click-button")
    for i in range(n):
        Trajectory.objects.create(
            run=run, task=task, eval_job=job, purpose=Purpose.EVAL, seed=i,
            status="succeeded" if i < ok else "failed", reward=1.0 if i < ok else 0.0,
        )  # fmt: skip


def test_a_runs_metrics_come_back_as_json_and_csv(api):
    ada = api("ada")
    run = Run.objects.get(pk=ada.post("runs/", json={"name": "m", "config": ORACLE}).json()["id"])
    greedy(run, 0, 3, 10)
    greedy(run, 1, 6, 10)
    greedy(run, 1, 2, 4, scope=EvalScope.HELDOUT)
    for n in (1, 2):
        TrainUpdate.objects.create(
            run=run, number=n, policy_version=n - 1,
            metrics={"loss": 0.5 / n, "logprob_gap_mean": 0.01 * n, "logprob_gap_p99": 0.1},
        )  # fmt: skip
    data = ada.get(f"runs/{run.pk}/metrics/").json()
    train = [p for p in data["greedy"] if p["scope"] == "train_instances"]
    assert [(p["version"], p["ok"], p["scored"], p["rate"]) for p in train] == [
        (0, 3, 10, 0.3), (1, 6, 10, 0.6)]  # fmt: skip
    assert all(p["low"] < p["rate"] < p["high"] for p in train)
    assert data["updates"]["number"] == [1, 2] and data["updates"]["series"]["loss"] == [0.5, 0.25]
    assert data["logprob_gap"]["mean"] == [0.01, 0.02]

    text = ada.get(f"runs/{run.pk}/metrics.csv").text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [(r["scope"], r["version"], r["rate"]) for r in rows] == [
        ("train_instances", "0", "0.3"), ("train_instances", "1", "0.6"), ("heldout", "1", "0.5")]  # fmt: skip
    updates = list(
        csv.DictReader(
            io.StringIO(ada.get(f"runs/{run.pk}/metrics.csv", params={"kind": "updates"}).text)
        )
    )
    assert updates[1]["update"] == "2" and updates[1]["logprob_gap_mean"] == "0.02"
    bad = ada.get(f"runs/{run.pk}/metrics.csv", params={"kind": "vibes"})
    assert problem_of(bad) == (400, "invalid", "kind")


def test_a_sweep_runs_its_members_one_after_another_and_lines_up_their_curves(api, ada_client):
    ada = api("ada")
    made = ada.post(
        "sweeps/",
        json={"name": "lr", "config": ORACLE, "grid": {"trainer.lr": [1e-5, 5e-5]}, "seeds": 2},
    )
    assert made.status_code == 201, made.text
    sweep = made.json()
    members = sweep["members"]
    assert [m["overrides"] for m in members] == [
        {"trainer.lr": 1e-5, "seed": 0}, {"trainer.lr": 1e-5, "seed": 1},
        {"trainer.lr": 5e-5, "seed": 0}, {"trainer.lr": 5e-5, "seed": 1},
    ]  # fmt: skip
    assert [m["run"]["status"] for m in members] == ["running", "created", "created", "created"]
    runs = [Run.objects.get(pk=m["run"]["id"]) for m in members]
    assert [r.config["trainer"]["lr"] for r in runs] == [1e-5, 1e-5, 5e-5, 5e-5]
    assert [r.config["seed"] for r in runs] == [0, 1, 0, 1] and {
        r.owner.username for r in runs
    } == {"ada"}
    assert ada.get("runs/", params={"sweep": sweep["id"]}).json()["count"] == 4

    assert sweeps_advance() == []  # the first still runs
    for i, run in enumerate(runs):
        greedy(run, 0, 2, 10)
        greedy(run, 1, 4 + i, 10)
        assert Run.objects.get(pk=run.pk).status == RunStatus.RUNNING
        assert run_finish(run_id=run.pk, message="finished: 1 update")
        assert sweeps_advance() == ([runs[i + 1].pk] if i < 3 else [])
    assert {
        r["status"] for r in ada.get("runs/", params={"sweep": sweep["id"]}).json()["results"]
    } == {"finished"}

    page = ada_client.get(f"/sweeps/{sweep['id']}/")
    assert page.status_code == 200
    figure = dict(page.context["figures"])["train_instances"]
    assert [t["y"] for t in figure["data"]] == [[0.2, 0.4], [0.2, 0.5], [0.2, 0.6], [0.2, 0.7]]
    assert "trainer.lr=5e-05 seed=1" in page.content.decode()
    rows = list(csv.DictReader(io.StringIO(ada.get(f"sweeps/{sweep['id']}/metrics.csv").text)))
    assert len(rows) == 8 and rows[7] == {
        "run": str(runs[3].pk), "trainer.lr": "5e-05", "seed": "1", "scope": "train_instances",
        "version": "1", "ok": "7", "scored": "10", "rate": "0.7", "low": rows[7]["low"], "high": rows[7]["high"],
    }  # fmt: skip
    assert ada_client.get("/sweeps/").status_code == 200


def test_a_sweep_with_a_bad_member_makes_nothing_and_says_which(api):
    ada = api("ada")
    refused = ada.post(
        "sweeps/", json={"name": "bad", "config": ORACLE, "grid": {"trainer.lr": [1e-5, -1]}}
    )
    assert problem_of(refused) == (400, "invalid_config", "trainer.lr")
    assert "(with trainer.lr=-1 seed=0)" in refused.json()["message"]
    for body, field in (
        ({"grid": {"trainer.lr": []}}, "grid.trainer.lr"),
        ({"grid": {"seed": [1, 2]}, "seeds": 2}, "seeds"),
        ({"seeds": 0}, "seeds"),
        ({"parallel": 99}, "parallel"),
        ({"grid": {"trainer.lr": [1e-5] * 2}}, "grid.trainer.lr"),
    ):
        response = ada.post("sweeps/", json={"name": "bad", "config": ORACLE, **body})
        assert problem_of(response)[0] == 400 and problem_of(response)[2] == field, response.json()
    assert not Run.objects.exists() and not Sweep.objects.exists()


def test_only_the_owner_or_an_admin_stops_a_sweep(api):
    ada, bob = api("ada"), api("bob")
    sweep = ada.post(
        "sweeps/", json={"name": "s", "config": ORACLE, "grid": {"seed": [1, 2]}}
    ).json()
    assert problem_of(bob.post(f"sweeps/{sweep['id']}/stop/"))[:2] == (403, "not_your_run")
    stopped = ada.post(f"sweeps/{sweep['id']}/stop/").json()
    assert stopped["stopped_at"] and [m["run"]["status"] for m in stopped["members"]] == [
        "stopped",
        "created",
    ]
    assert sweeps_advance() == []  # the rest never start
