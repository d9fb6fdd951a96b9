"""Every process's log of a run, on whatever host it runs, is read from the API and the run
page without a shell there: the host agent copies the end of each log its run groups write
to the database, secrets written as ***, again when it changes, once more with the last
words of a run that stopped, and only its end when it outgrows the bound. Real child
processes (Python scripts that print, one printing the tokens its environment holds), the
host agent's tick, the API through Django's test client."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import Host, PlacementState, Run, RunPlacement, RunProcessLog, RunStatus
from datamanager.services.placement import placement_claim, placement_queue
from datamanager.services.process_logs import TAIL_BYTES, process_log_record
from datamanager.services.runs import run_create
from datamanager.services.tokens import api_token_create
from hostagent.agent import HostAgent, run_prefix
from hostagent.launcher import ProcSpec, Supervisor
from hostagent.log_ship import SHIP_EVERY_S, LogShipper, read_tail
from hostagent.placement import Placement
from tests.conftest import user_in_role

pytestmark = pytest.mark.django_db

CHILD_SECRET = "child-only-key-0123456789"  # in one child's own environment (ProcSpec.env)
# Prints its start, the tokens it holds (as a careless debug line would), waits for the
# test's go file, prints more, and says goodbye on SIGTERM.
SERVER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    def bye(*_):
        print("stopping on SIGTERM", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    for shard in range(3):
        print(f"loading shard {shard}", flush=True)
    print("admin token", os.environ["DARTBOARD_ADMIN_TOKEN"], flush=True)
    print("own key", os.environ.get("MODEL_API_KEY", "-"), flush=True)
    print("ready", flush=True)
    while not Path(sys.argv[1]).exists():
        time.sleep(0.05)
    print("second batch", flush=True)
    while True:
        time.sleep(1)
    """
)
# 5000 lines of 100 bytes: about 500 KB, eight times the bound.
CHATTY = "import time\nfor i in range(5000): print(f'line {i:05d} ' + 'x' * 88)\ntime.sleep(60)"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def wait_for(pred: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def logged(group: Supervisor, name: str, text: str) -> bool:
    path = group.log_path(name)
    return path.exists() and text in path.read_text()


def placed_run(host: Host) -> Run:
    """A running run placed on `host`, as its agent left it."""
    run = run_create(name="logs", config=RunConfig())
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
    placement = placement_queue(run_id=run.pk)
    plan = Placement(host=host.name, device="cpu").to_dict()  # no router: a scripted run's
    assert placement_claim(placement_id=placement.pk, host=host, plan=plan, router_url="")
    RunPlacement.objects.filter(pk=placement.pk).update(state=PlacementState.UP)
    return run


def bearer(user) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {api_token_create(user=user, name='tests').secret}"}


@pytest.mark.django_db(transaction=True)  # the agent's tick closes old connections
def test_the_agent_copies_each_log_and_the_api_and_the_run_page_read_it(
    tmp_path: Path, client, ada_client, django_user_model
) -> None:
    host = Host.objects.create(name="gpu-1", last_seen=timezone.now())
    run = placed_run(host)
    agent = HostAgent(home=tmp_path, name="gpu-1")
    clock = Clock()
    agent.log_shipper = LogShipper(host="gpu-1", prefix=run_prefix, clock=clock)
    prefix, go = run_prefix(run.pk), tmp_path / "go"
    server = [sys.executable, "-c", SERVER, str(go)]
    group = Supervisor(
        home=tmp_path,
        specs=[
            ProcSpec(f"{prefix}inference-0", server, env={"MODEL_API_KEY": CHILD_SECRET}),
            ProcSpec(f"{prefix}router", server),
        ],
        group=f"run-{run.pk}",
    )
    group.start()
    agent.groups[run.pk] = group
    try:
        for name in group.children:
            wait_for(lambda name=name: logged(group, name, "ready"), f"{name} ready")
        agent.tick()

        viewer = bearer(user_in_role(django_user_model, "victor", "viewer"))
        listed = client.get(f"/api/v1/runs/{run.pk}/logs/", **viewer)
        assert listed.status_code == 200, listed.content
        rows = {(r["host"], r["process"]): r for r in listed.json()}
        assert set(rows) == {("gpu-1", "inference-0"), ("gpu-1", "router")}
        inference = rows["gpu-1", "inference-0"]
        assert inference["running"] is True
        assert inference["size"] == group.log_path(f"{prefix}inference-0").stat().st_size
        text = client.get(inference["url"], **viewer)
        assert text.status_code == 200 and text["Content-Type"].startswith("text/plain")
        tail = text.content.decode()
        assert tail.startswith("loading shard 0\n") and tail.endswith("ready\n")
        assert "admin token ***\n" in tail and "own key ***\n" in tail
        for secret in (os.environ["DARTBOARD_ADMIN_TOKEN"], CHILD_SECRET):
            assert secret not in "".join(r.tail for r in RunProcessLog.objects.all())

        # Nothing changed: nothing is written again, even once the interval has passed.
        clock.now += SHIP_EVERY_S
        assert agent.log_shipper.ship(agent.groups) == 0
        go.touch()
        for name in group.children:
            wait_for(lambda name=name: logged(group, name, "second batch"), f"{name} again")
        assert agent.log_shipper.ship(agent.groups) == 0  # within the interval: not yet
        clock.now += SHIP_EVERY_S
        agent.tick()
        again = client.get(f"/api/v1/runs/{run.pk}/logs/inference-0/", **viewer)
        assert again.content.decode().endswith("ready\nsecond batch\n")

        # The run stops: its processes stop, and what they said last is copied at once.
        Run.objects.filter(pk=run.pk).update(status=RunStatus.STOPPED)
        agent.tick()
        assert run.pk not in agent.groups
    finally:
        group.stop()
    stopped = RunProcessLog.objects.get(run=run, process="router")
    assert stopped.tail.endswith("second batch\nstopping on SIGTERM\n")
    assert stopped.running is False

    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert 'id="process-logs"' in page and "<td>gpu-1</td><td>router</td><td>stopped</td>" in page
    link = re.search(rf'href="(/runs/{run.pk}/logs/router/\?host=gpu-1)"', page)
    assert link, page
    assert ada_client.get(link.group(1)).content.decode() == stopped.tail


def test_a_log_over_the_bound_keeps_its_end_from_a_whole_line(tmp_path: Path) -> None:
    run = run_create(name="chatty", config=RunConfig())
    name = f"{run_prefix(run.pk)}worker-train"
    group = Supervisor(home=tmp_path, specs=[ProcSpec(name, [sys.executable, "-c", CHATTY])])
    group.start()
    try:
        wait_for(lambda: logged(group, name, "line 04999"), "the last line")
        shipper = LogShipper(host="cpu-1", prefix=run_prefix)
        assert shipper.ship({run.pk: group}) == 1
    finally:
        group.stop()
    row = RunProcessLog.objects.get(run=run)
    assert (row.host, row.process, row.size) == ("cpu-1", "worker-train", 5000 * 100)
    assert TAIL_BYTES - 100 < len(row.tail.encode()) <= TAIL_BYTES
    lines = row.tail.splitlines()
    assert lines[-1] == "line 04999 " + "x" * 88
    assert all(re.fullmatch(r"line \d{5} x{88}", line) for line in lines)  # the first whole
    assert int(lines[0].split()[1]) == 5000 - len(lines)  # and none missing after it


def test_only_who_may_see_the_run_reads_its_logs_and_a_name_on_two_hosts_needs_one(
    client, django_user_model
) -> None:
    run = run_create(name="two hosts", config=RunConfig())
    for host in ("gpu-1", "gpu-2"):
        process_log_record(run_id=run.pk, host=host, process="worker-env-0",
                           tail=f"on {host}\n", size=8, running=True)  # fmt: skip  # one row
    process_log_record(run_id=run.pk, host="gpu-1", process="router", tail="up\x00\n", size=4,
                       running=True)  # fmt: skip  # one row; a NUL PostgreSQL's text cannot hold
    viewer = bearer(user_in_role(django_user_model, "victor", "viewer"))
    logs = f"/api/v1/runs/{run.pk}/logs/"

    nobody = bearer(django_user_model.objects.create_user("mallory", password="m-pass-12345"))
    for path in (logs, f"{logs}router/"):
        refused = client.get(path, **nobody)
        assert refused.status_code == 403, refused.content
        assert refused.json()["code"] == "permission_denied"
        assert client.get(path).status_code == 401
    assert client.get(f"/api/v1/runs/{run.pk + 1}/logs/", **viewer).status_code == 404
    assert client.get(f"/api/v1/runs/{run.pk + 1}/logs/router/", **viewer).status_code == 404

    assert client.get(f"{logs}router/", **viewer).content.decode() == "up\ufffd\n"
    assert client.get(f"{logs}router%00/", **viewer).status_code == 404
    both = client.get(f"{logs}worker-env-0/", **viewer).json()
    assert (both["code"], both["field"]) == ("invalid", "host")
    assert both["message"] == (
        f"run {run.pk} has worker-env-0 on 2 hosts (gpu-1, gpu-2): name one with host"
    )
    one = client.get(f"{logs}worker-env-0/", {"host": "gpu-2"}, **viewer)
    assert one.content == b"on gpu-2\n"
    missing = client.get(f"{logs}trainer/", **viewer).json()
    assert missing["message"] == (
        f"run {run.pk} has no log of trainer; its logs: router on gpu-1, worker-env-0 on "
        "gpu-1, worker-env-0 on gpu-2"
    )
    assert client.get(f"{logs}router/", {"host": "gpu-2"}, **viewer).status_code == 404

    # The dashboard: the same rule for a signed-in user without the viewer role.
    client.force_login(django_user_model.objects.get(username="mallory"))
    assert client.get(f"/runs/{run.pk}/logs/router/").status_code == 403


def test_a_progress_bar_without_a_newline_keeps_its_end(tmp_path: Path) -> None:
    path = tmp_path / "run-1-worker-train.log"
    path.write_bytes(b"".join(b"\rloading %5d/10000" % i for i in range(10001)))
    tail = read_tail(path, limit=1024)
    assert (len(tail.text), tail.size) == (1024, path.stat().st_size)
    assert tail.text.endswith("\rloading 10000/10000")
