"""`manage.py start_run` starts a run from a settings file; `manage.py host_agent` (another
process, as on another host) brings up its processes and stops them with the run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from django.core.management import CommandError, call_command

from datamanager.models import Host, Run, RunPlacement, RunStatus, Trajectory
from datamanager.services.run_workers import run_apply
from tests.helpers import port_base_for_runs

ROOT = Path(__file__).resolve().parents[2]
SIM_ORACLE = {
    "policy": "oracle",
    "tasks": {"env_kinds": ["sim"], "tags": ["sim"]},
    "env": {"miniwob_slots": 0, "sim_slots": 2},
}


@pytest.mark.django_db
def test_a_settings_file_is_checked_and_says_what_is_wrong_where(tmp_path, settings):
    broken = tmp_path / "broken.json"
    broken.write_text('{"trainer": {"lr": 1e-4,}}')
    with pytest.raises(CommandError, match=r"broken.json: not valid json: .*line 1"):
        call_command("start_run", str(broken))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trainer:\n  learning_rate: 0.001\n")
    with pytest.raises(CommandError, match=r"unknown.yaml: trainer.learning_rate: unknown"):
        call_command("start_run", str(unknown))
    with pytest.raises(CommandError, match=r"missing.json: cannot read it"):
        call_command("start_run", str(tmp_path / "missing.json"))
    assert not Run.objects.exists()
    # Valid, under a host agent that never comes: the run waits, queued, and says so.
    settings.DARTBOARD_PROCESSES = "per-run"
    good = tmp_path / "lr.yaml"
    good.write_text("trainer:\n  lr: 0.0001\nrollout:\n  max_new_tokens: 48\n")
    with pytest.raises(CommandError, match="still queued after 1 s: queued: waiting for a host"):
        call_command("start_run", str(good), wait=1)
    run = Run.objects.get()
    assert (run.name, run.status, run.config["trainer"]["lr"]) == ("lr", "queued", 1e-4)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_run_started_from_a_file_runs_on_the_host_agent_and_stops_with_its_processes(
    subprocess_env, tmp_path
):
    # The sim env waits like OSWorld (resets 20-60 s): a fiftieth of that here.
    env = {**subprocess_env, "DARTBOARD_PROCESSES": "auto", "DARTBOARD_ENV_LATENCY_SCALE": "0.02"}
    call_command("import_builtin_tasks")
    agent = subprocess.Popen(
        [sys.executable, "manage.py", "host_agent", "--name", "agent-host",
         "--port-base", str(port_base_for_runs())],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not Host.objects.filter(name="agent-host").exists():  # its first report
            assert time.monotonic() < deadline and agent.poll() is None, "no report from the agent"
            time.sleep(0.5)
        config = tmp_path / "sim-oracle.json"
        config.write_text(json.dumps(SIM_ORACLE))
        # A fresh process with DARTBOARD_PROCESSES=auto finds the live agent and queues.
        started = subprocess.run(
            [sys.executable, "manage.py", "start_run", str(config), "--wait", "120"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        run = Run.objects.get()
        assert f"run #{run.pk} 'sim-oracle' is queued" in started.stdout
        assert f"run #{run.pk} is running" in started.stdout
        assert RunPlacement.objects.get(run=run).host == Host.objects.get(name="agent-host")
        deadline = time.monotonic() + 120
        while not Trajectory.objects.filter(run=run, status="succeeded").count() >= 2:
            assert time.monotonic() < deadline, "no episodes on the agent's workers"
            time.sleep(1)
        workers = [
            p.pid for p in psutil.Process(agent.pid).children()
            if "env.run" in " ".join(p.cmdline())
        ]  # fmt: skip
        assert len(workers) == 2
        run_apply(run_id=run.pk, action="stop")
        gone = psutil.wait_procs([psutil.Process(pid) for pid in workers], timeout=90)[1]
        assert gone == [] and Run.objects.get(pk=run.pk).status == RunStatus.STOPPED
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            out, _ = agent.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            agent.kill()  # its workers die with it (die_with_parent)
            out, _ = agent.communicate()
            raise AssertionError(f"the agent did not stop on SIGTERM:\n{out[-3000:]}") from None
    assert "stopped" in out, out[-2000:]
