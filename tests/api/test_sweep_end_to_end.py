"""A sweep end to end on this machine: `dartboard sweep` makes two runs of a tiny config
(the shipped policy on one simulated task, one update each), a host agent starts each run's
own processes, each run finishes at its max_updates once its last evaluation ended, the next
starts only then, and both curves come back on the sweep's page and as CSV."""

from __future__ import annotations

import csv
import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core.management import call_command

from datamanager.models import Host, Run, RunStatus, Sweep
from datamanager.services.sweeps import ACTIVE, sweeps_advance
from tests.helpers import port_base_for_runs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DARTBOARD = Path(sys.executable).parent / "dartboard"
TINY = """\
policy: shipped
tasks: {names: [sim/click-1], env_kinds: [sim], instances: 1}
env: {miniwob_slots: 0, sim_slots: 1}
rollout: {max_new_tokens: 24}
curation: {n_max: 2, n_min: 2}
trainer: {min_groups: 1, max_updates: 1, micro_batch: 4, kl_coef: 0.0}
evaluation: {every_n_versions: 1, eval_split: false, train_instances: true, slot_share: 1.0}
"""


def test_a_sweep_runs_its_members_one_after_another_to_the_end(
    api, api_url, subprocess_env, ada_client, tmp_path
):
    # The sim env waits like OSWorld (resets 20-60 s): a fiftieth of that here.
    env = {**subprocess_env, "DARTBOARD_PROCESSES": "auto", "DARTBOARD_ENV_LATENCY_SCALE": "0.02"}
    call_command("import_builtin_tasks")
    token = api("ada").headers["Authorization"].removeprefix("Bearer ")
    agent = subprocess.Popen(
        [sys.executable, "manage.py", "host_agent", "--name", "sweep-host",
         "--port-base", str(port_base_for_runs())],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not Host.objects.filter(name="sweep-host").exists():  # its first report
            assert time.monotonic() < deadline and agent.poll() is None, "no report from the agent"
            time.sleep(0.5)
        (tmp_path / "tiny.yaml").write_text(TINY)
        made = subprocess.run(
            [str(DARTBOARD), "sweep", "tiny.yaml", "--grid", "trainer.lr=1e-5,5e-5"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
            env={**env, "DARTBOARD_URL": api_url, "DARTBOARD_TOKEN": token},
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        sweep = Sweep.objects.get()
        runs = [m.run_id for m in sweep.members.order_by("index")]
        most_at_once, started = 0, time.monotonic()
        while time.monotonic() - started < 400:  # Celery beat's part: advance the sweep
            sweeps_advance()
            statuses = dict(Run.objects.filter(pk__in=runs).values_list("pk", "status"))
            most_at_once = max(most_at_once, sum(s in ACTIVE for s in statuses.values()))
            if all(s == RunStatus.FINISHED for s in statuses.values()):
                break
            assert not {RunStatus.FAILED, RunStatus.STOPPED} & set(statuses.values()), [
                (r.pk, r.status, r.status_message) for r in Run.objects.filter(pk__in=runs)
            ]
            time.sleep(1)
        took = time.monotonic() - started
        ends = [Run.objects.get(pk=pk) for pk in runs]
        assert [r.status for r in ends] == ["finished", "finished"], [
            (r.status, r.status_message) for r in ends
        ]
        assert most_at_once == 1 and ends[0].finished_at <= ends[1].started_at
        print(f"two sweep members ran to the end in {took:.0f} s")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=120)
    page = ada_client.get(f"/sweeps/{sweep.pk}/")
    figure = dict(page.context["figures"])["train_instances"]
    assert [t["x"] for t in figure["data"]] == [[0, 1], [0, 1]]
    rows = list(csv.DictReader(io.StringIO(api("ada").get(f"sweeps/{sweep.pk}/metrics.csv").text)))
    assert [(r["trainer.lr"], r["version"]) for r in rows] == [
        ("1e-05", "0"), ("1e-05", "1"), ("5e-05", "0"), ("5e-05", "1")]  # fmt: skip
