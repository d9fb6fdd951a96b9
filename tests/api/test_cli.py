"""The `dartboard` command (installed in .venv by make install) and `dartboard_client.Client`
against a live server, as a researcher uses them from a shell and a notebook."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from datamanager.config import RunConfig
from datamanager.models import Run, RunStatus, Sweep, Task
from datamanager.services.runs import run_create
from hostagent.agent import run_prefix
from hostagent.launcher import ProcSpec, Supervisor
from hostagent.log_ship import LogShipper
from tests.dartboard.run_helpers import make_run
from tests.dartboard.test_curation_views import finished
from tests.hostagent.test_log_ship import logged, wait_for

DARTBOARD = Path(sys.executable).parent / "dartboard"
CONFIG = """\
policy: oracle
env:
  miniwob_slots: 1
trainer:
  lr: 1.0e-5
"""


@pytest.fixture
def shell(api, api_url, tmp_path):
    """shell(*args, token=...) -> the finished `dartboard` process, as Ada by default."""
    Task.objects.get_or_create(name="click-button", defaults={"env_kind": "miniwob"})
    token = api("ada").headers["Authorization"].removeprefix("Bearer ")
    (tmp_path / "cfg.yaml").write_text(CONFIG)

    def run(*args: str, token: str | None = token) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DARTBOARD_")}
        env.update(DARTBOARD_URL=api_url, DARTBOARD_CLIENT_CONFIG=str(tmp_path / "none.yaml"))
        if token:
            env["DARTBOARD_TOKEN"] = token
        return subprocess.run([str(DARTBOARD), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    run.token = token  # type: ignore[attr-defined]
    return run


def test_create_start_watch_stop_and_read_metrics_from_the_shell(shell):
    made = shell(
        "run", "create", "cfg.yaml", "--set", "trainer.lr=5e-5", "--set", "seed=3", "--start"
    )
    assert made.returncode == 0, made.stderr
    run = Run.objects.get()
    assert made.stdout.strip() == f"#{run.pk} cfg: running"
    assert (run.config["trainer"]["lr"], run.config["seed"], run.owner.username) == (5e-5, 3, "ada")
    assert shell("run", "pause", str(run.pk)).stdout.strip() == f"#{run.pk} cfg: paused"
    assert shell("run", "stop", str(run.pk)).returncode == 0
    watched = shell("run", "watch", str(run.pk), "--interval", "0.1")
    assert (
        watched.returncode == 0
        and f"#{run.pk} cfg: stopped | no greedy evaluation yet" in watched.stdout
    )
    metrics = shell("metrics", str(run.pk), "--csv")
    assert metrics.stdout.splitlines() == ["scope,version,ok,scored,rate,low,high"]
    refused = shell("run", "resume", str(run.pk))
    assert refused.returncode == 1
    assert refused.stderr.strip() == "error (conflict): cannot resume a run that is stopped"


def test_every_problem_of_a_bad_config_is_printed_and_nothing_is_made(shell, tmp_path):
    (tmp_path / "bad.yaml").write_text(
        "trainer:\n  lr: -1\n  bogus: 2\nenv:\n  miniwob_slots: 99\n"
    )
    refused = shell("run", "create", "bad.yaml")
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert lines[0] == "error (invalid_config): 3 problems:"
    assert {line.split(":")[0].strip() for line in lines[1:]} == {
        "trainer.bogus", "trainer.lr", "env.miniwob_slots"}  # fmt: skip
    unset = shell("run", "create", "cfg.yaml", "--set", "trainer")
    assert unset.returncode == 2 and "is not SETTING=VALUE" in unset.stderr
    assert not Run.objects.exists()


def test_a_sweep_from_the_shell_and_its_curves_as_csv(shell):
    made = shell("sweep", "cfg.yaml", "--grid", "trainer.lr=1e-5,5e-5", "--seeds", "2")
    assert made.returncode == 0, made.stderr
    sweep = Sweep.objects.get()
    assert made.stdout.splitlines()[0].startswith(
        f"sweep #{sweep.pk} cfg: 4 runs, http://127.0.0.1:"
    )
    assert [r.status for r in Run.objects.order_by("pk")] == [
        "running",
        "created",
        "created",
        "created",
    ]
    assert sorted((r.config["trainer"]["lr"], r.config["seed"]) for r in Run.objects.all()) == [
        (1e-5, 0), (1e-5, 1), (5e-5, 0), (5e-5, 1)]  # fmt: skip
    curves = shell("sweeps", "metrics", str(sweep.pk))
    assert curves.stdout.splitlines() == [
        "run,trainer.lr,seed,scope,version,ok,scored,rate,low,high"
    ]
    assert shell("sweeps", "stop", str(sweep.pk)).returncode == 0
    assert Run.objects.filter(status=RunStatus.RUNNING).count() == 0


def test_failed_trajectories_of_a_run_from_the_shell(shell):
    run = make_run(policy="oracle")
    lost = {finished(run, success=False).pk for _ in range(3)}
    finished(run, success=True)
    listed = shell("trajectories", "--run", str(run.pk), "--status", "failed", "--limit", "50")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == "3 trajectories"
    assert {int(line.split()[0][1:]) for line in lines[1:]} == lost
    typo = shell("trajectories", "--filter", "statuss=failed")
    assert typo.returncode == 1 and "unknown parameter 'statuss'" in typo.stderr


def test_a_second_model_run_on_the_shared_workers_is_refused_from_the_shell(shell):
    """The web server runs in shared mode (no host agent reports): the CLI prints the API's
    refusal, naming the run that holds the inference workers."""
    first = make_run()
    second = run_create(name="second", config=RunConfig.from_dict(first.config))
    refused = shell("run", "start", str(second.pk))
    assert refused.returncode == 1
    assert refused.stderr.startswith(
        f"error (not_startable): run #{first.pk} 'click-run' is running on the shared "
        "inference workers"
    ), refused.stderr
    assert Run.objects.get(pk=second.pk).status == RunStatus.CREATED


def test_no_token_says_what_to_do(shell):
    refused = shell("whoami", token=None)
    assert refused.returncode == 1 and "error (not_authenticated)" in refused.stderr
    assert shell("whoami").stdout.strip() == "ada (operator): may view, create, control, curate"


def test_a_notebook_reads_a_runs_curve_with_the_client(api_url, shell, tmp_path, monkeypatch):
    from dartboard_client import Client, DartboardError

    run = make_run(policy="oracle")
    (tmp_path / "client.yaml").write_text(f"url: {api_url}\ntoken: {shell.token}\n")
    monkeypatch.setenv("DARTBOARD_CLIENT_CONFIG", str(tmp_path / "client.yaml"))
    monkeypatch.delenv("DARTBOARD_URL", raising=False)
    monkeypatch.delenv("DARTBOARD_TOKEN", raising=False)
    with Client() as client:
        assert client.me()["username"] == "ada"
        assert client.metrics_rows(run.pk) == []
        updates = client.metrics_csv(run.pk, "updates")
        assert list(csv.reader(io.StringIO(updates))) == [["update"]]
        with pytest.raises(DartboardError) as refused:
            client.run_create(name="bad", config={"trainer": {"lr": 0}})
        assert refused.value.code == "invalid_config" and refused.value.field == "trainer.lr"


def test_a_runs_process_logs_on_two_hosts_from_the_shell(shell, tmp_path):
    """Each host's agent copies its processes' logs (`LogShipper`, as the agent's tick
    does); `dartboard run logs` lists them and prints one, naming the host where the run has
    a process of that name on both."""
    run = run_create(name="spread", config=RunConfig())
    name = f"{run_prefix(run.pk)}worker-env-0"
    groups = {}
    for host in ("gpu-1", "gpu-2"):
        prints = f"import time; print('episode 1 on {host}', flush=True); time.sleep(60)"
        spec = ProcSpec(name, [sys.executable, "-c", prints])
        groups[host] = Supervisor(home=tmp_path / host, specs=[spec])
        groups[host].start()
    try:
        for host, group in groups.items():
            wait_for(lambda group=group, host=host: logged(group, name, host), f"{host}'s log")
            assert LogShipper(host=host, prefix=run_prefix).ship({run.pk: group}) == 1
    finally:
        for group in groups.values():
            group.stop()

    listed = shell("run", "logs", str(run.pk))
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[:4] for line in listed.stdout.splitlines()] == [
        ["gpu-1", "worker-env-0", "running", "19"],
        ["gpu-2", "worker-env-0", "running", "19"],
    ]
    both = shell("run", "logs", str(run.pk), "worker-env-0")
    assert both.returncode == 1
    assert both.stderr.strip() == (
        f"error (invalid): run {run.pk} has worker-env-0 on 2 hosts (gpu-1, gpu-2): name one "
        "with host"
    )
    one = shell("run", "logs", str(run.pk), "worker-env-0", "--host", "gpu-2")
    assert (one.returncode, one.stdout) == (0, "episode 1 on gpu-2\n")
    gone = shell("run", "logs", str(run.pk), "trainer")
    assert gone.returncode == 1
    assert f"run {run.pk} has no log of trainer; its logs: worker-env-0 on gpu-1" in gone.stderr
