"""A process that keeps failing at start is not restarted for ever: its run fails with the
process's last words, on the run's page and in the API, and its data stays. Real child
processes (a Python that exits as a worker refusing its checkpoint does)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import Host, PlacementState, Run, RunPlacement, RunStatus
from datamanager.services.placement import placement_claim, placement_queue
from datamanager.services.runs import run_create
from datamanager.services.tokens import api_token_create
from hostagent.agent import HostAgent, run_prefix
from hostagent.launcher import ProcSpec, Supervisor

REFUSAL = "checkpoint /models/qwen is outside the checkpoint roots (/srv/checkpoints)"
FAILS = [sys.executable, "-c", f"import sys; print('loading'); sys.exit({REFUSAL!r})"]
STAYS = [sys.executable, "-c", "import time; time.sleep(60)"]


def watch_until(supervisor: Supervisor, pred, *, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out; logs in {supervisor.log_dir}"
        supervisor.watch_once()
        time.sleep(0.05)


def test_a_child_failing_at_start_is_given_up_after_the_limit(tmp_path: Path) -> None:
    supervisor = Supervisor(
        home=tmp_path,
        specs=[ProcSpec("worker", FAILS), ProcSpec("steady", STAYS)],
        give_up_after=3,
        first_backoff_s=0.05,
    )
    supervisor.start()
    try:
        watch_until(supervisor, supervisor.gave_up)
        (gave_up,) = supervisor.gave_up()
        assert (gave_up.name, gave_up.failed_starts, gave_up.exit_code) == ("worker", 3, 1)
        assert gave_up.last_line == REFUSAL
        assert supervisor.children["worker"].restarts == 2  # started three times in all
        for _ in range(20):  # and never again
            supervisor.watch_once()
        assert supervisor.children["worker"].restarts == 2
        assert supervisor.children["steady"].proc.poll() is None  # the others run on
    finally:
        supervisor.stop()


def test_without_a_limit_it_is_restarted_as_before(tmp_path: Path) -> None:
    supervisor = Supervisor(home=tmp_path, specs=[ProcSpec("worker", FAILS)], first_backoff_s=0.05)
    supervisor.start()
    try:
        watch_until(supervisor, lambda: supervisor.children["worker"].restarts >= 4)
        assert not supervisor.gave_up()
    finally:
        supervisor.stop()


@pytest.mark.django_db
def test_the_run_fails_with_the_process_last_line_and_keeps_its_data(
    tmp_path: Path, ada_client, client, researcher
) -> None:
    host = Host.objects.create(name="cpu-1", last_seen=timezone.now())
    run = run_create(name="own", config=RunConfig())
    Run.objects.filter(pk=run.pk).update(status=RunStatus.QUEUED)  # started, its processes starting
    placement = placement_queue(run_id=run.pk)
    plan = {"host": "cpu-1", "device": "cpu", "inference_gpus": [None], "router_port": 8200,
            "worker_ports": [8201]}  # fmt: skip  # the plan as an agent writes it, one line
    assert placement_claim(placement_id=placement.pk, host=host, plan=plan, router_url="")
    agent = HostAgent(home=tmp_path, name="cpu-1")
    name = f"{run_prefix(run.pk)}inference-0"
    group = Supervisor(home=tmp_path, specs=[ProcSpec(name, FAILS)], give_up_after=2,
                       first_backoff_s=0.05, group=f"run-{run.pk}")  # fmt: skip  # as the agent
    group.start()
    agent.groups[run.pk] = group
    try:
        watch_until(group, group.gave_up)
        agent._fail_what_cannot_start()
    finally:
        group.stop()
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.status_message.startswith("inference-0 on cpu-1 failed at start 2 times in a row")
    assert REFUSAL in run.status_message
    assert run.pk not in agent.groups  # its processes stopped
    assert RunPlacement.objects.get(run=run).state == PlacementState.ENDED
    assert Run.objects.filter(pk=run.pk).exists()
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert REFUSAL in page
    token = api_token_create(user=researcher, name="tests").secret
    api = client.get(f"/api/v1/runs/{run.pk}/", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    assert api["status"] == "failed" and REFUSAL in api["status_message"]


@pytest.mark.django_db
def test_a_run_on_a_host_that_stopped_reporting_is_placed_again(tmp_path: Path) -> None:
    from datetime import timedelta

    from hostagent.agent import HOST_LOST_S

    now = timezone.now()
    gone = Host.objects.create(name="gpu-1", last_seen=now - timedelta(seconds=HOST_LOST_S + 5))
    alive = Host.objects.create(name="gpu-2", last_seen=now)
    runs = {}
    for name, host in (("on-gone", gone), ("on-alive", alive)):
        run = run_create(name=name, config=RunConfig())
        Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
        placement = placement_queue(run_id=run.pk)
        assert placement_claim(placement_id=placement.pk, host=host, plan={"host": host.name},
                               router_url="http://10.0.0.1:8200")  # fmt: skip  # as an agent
        RunPlacement.objects.filter(pk=placement.pk).update(state=PlacementState.UP)
        runs[name] = run
    agent = HostAgent(home=tmp_path, name="gpu-2")
    agent._replace_lost_hosts()
    moved = RunPlacement.objects.get(run=runs["on-gone"])
    assert (moved.state, moved.host, moved.plan, moved.router_url) == (
        PlacementState.QUEUED,
        None,
        {},
        "",
    )
    assert moved.reason.startswith("its host gpu-1 stopped reporting at ")
    assert Run.objects.get(pk=runs["on-gone"].pk).status_message == moved.reason
    assert Run.objects.get(pk=runs["on-gone"].pk).status == RunStatus.RUNNING  # its data goes on
    kept = RunPlacement.objects.get(run=runs["on-alive"])
    assert (kept.state, kept.host) == (PlacementState.UP, alive)
    agent._replace_lost_hosts()  # once
    assert RunPlacement.objects.get(run=runs["on-gone"]).reason == moved.reason
