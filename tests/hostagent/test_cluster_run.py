"""One run placed over four hosts by their agents: its trainer's two replicas on two hosts
(gloo, FSDP2 sharded), its inference worker on a third, its env slots on a fourth.

Each host is a network namespace of the test's own (tests/netns.py) running only a host
agent (`manage.py host_agent`) with its own DARTBOARD_HOME and its own cluster address, and
what that host offers set by the agent's settings (CPU trainer and inference slots, env
kinds); a fifth holds PostgreSQL, Redis and an S3 server. No host can take the whole run, so
the agents place it over all four: nothing else tells them where to go. The run must train
and publish versions with both replicas in its group; a `kill -9` of the second replica
ends that update, its host's agent starts it again, the group forms again and the run goes
on publishing, with every finished trajectory and every version kept, none twice. (That the
two replicas take the one-process step is `tests/training/test_replicas.py`'s.)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.launcher import ProcSpec, Supervisor
from rollout.auth import ServiceTokens
from tests import netns
from tests.dartboard.test_multihost import BUCKET, ROOT, host_env
from tests.private_services import services_host

pytestmark = [pytest.mark.browser, pytest.mark.slow]

AGENTS = ("t1", "t2", "inf", "env")
OFFERS = {  # what each host's agent offers the cluster
    "t1": {"DARTBOARD_CPU_TRAINER_SLOTS": "1", "DARTBOARD_CPU_INFERENCE_SLOTS": "0",
           "DARTBOARD_ENV_KINDS": "none"},
    "t2": {"DARTBOARD_CPU_TRAINER_SLOTS": "1", "DARTBOARD_CPU_INFERENCE_SLOTS": "0",
           "DARTBOARD_ENV_KINDS": "none"},
    "inf": {"DARTBOARD_CPU_TRAINER_SLOTS": "0", "DARTBOARD_CPU_INFERENCE_SLOTS": "1",
            "DARTBOARD_ENV_KINDS": "none"},
    "env": {"DARTBOARD_CPU_TRAINER_SLOTS": "0", "DARTBOARD_CPU_INFERENCE_SLOTS": "0",
            "DARTBOARD_ENV_KINDS": "miniwob"},
}  # fmt: skip
SETTINGS = {
    "device": "cpu",
    "trainer.replicas": 2,
    "trainer.shard": True,
    "trainer.replica_timeout_s": 30,
}


class Cluster:
    def __init__(self, hosts: netns.VirtualHosts, homes: dict[str, Path]) -> None:
        self.hosts = hosts
        self.homes = homes
        self.agents: dict[str, Supervisor] = {}
        self.observer: subprocess.Popen[str] | None = None

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.observer is not None and self.observer.stdin and self.observer.stdout
        self.observer.stdin.write(json.dumps(request) + "\n")
        self.observer.stdin.flush()
        reply = json.loads(self.observer.stdout.readline() or '{"error": "observer exited"}')
        assert "error" not in reply, reply["error"]
        return reply

    def wait(self, pred: Callable[[dict[str, Any]], Any], run: int, *, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            for agent in self.agents.values():
                agent.watch_once()
            state = self.ask(op="cluster", run=run)
            if pred(state):
                return state
            time.sleep(2)
        raise AssertionError(
            f"timed out after {timeout:.0f} s waiting for {what}; logs under "
            f"{', '.join(map(str, self.homes.values()))}; last state "
            f"{ {k: v for k, v in state.items() if k != 'trajectories'} }"
        )

    def log(self, host: str, name: str) -> str:
        path = self.homes[host] / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _pids_in(namespace: str, needle: str) -> list[int]:
    """The processes in `namespace` whose command line holds `needle`."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    found = []
    for pid in map(int, out.stdout.split()):
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(pid)
    return found


@contextlib.contextmanager
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    hosts = netns.VirtualHosts(["svc", *AGENTS])
    cleanups: list[Callable[[], None]] = [hosts.remove]
    try:
        hosts.create()
        yield _bring_up(hosts, tmp_path, cleanups)
    finally:
        for cleanup in reversed(cleanups):
            with contextlib.suppress(Exception):
                cleanup()


def _bring_up(hosts: netns.VirtualHosts, tmp_path: Path, cleanups: list) -> Cluster:
    svc = hosts.address("svc")
    services = services_host(address=svc, wrap=lambda argv: hosts.argv("svc", argv),
                             redis_dir=tmp_path / "svc-redis", cleanups=cleanups,
                             buckets=(BUCKET,))  # fmt: skip  # one call
    for port in (5432, 6379, 9000):
        hosts.wait_tcp("t1", svc, port)

    token = secrets.token_urlsafe(32)
    common = {
        "REDIS_URL": services.redis_url,
        "DARTBOARD_SERVICE_TOKEN": token,
        **ServiceTokens.derived(token).environ(),
        "DARTBOARD_PROCESSES": "per-run",
    }
    homes = {h: tmp_path / f"home-{h}" for h in AGENTS}
    envs = {
        h: host_env(hosts, h, homes[h], DARTBOARD_HOST_ADDRESS=hosts.address(h), **common,
                    **OFFERS[h])
        for h in AGENTS
    }  # fmt: skip
    python = sys.executable
    hosts.run("t1", [python, "manage.py", "migrate", "--no-input"], env=envs["t1"], timeout=300)
    deploy = Cluster(hosts, homes)
    for h in AGENTS:
        name = hosts.hostname(h)
        spec = ProcSpec("agent", hosts.argv(h, [python, "manage.py", "host_agent", "--name", name]))
        spec.env = envs[h]
        agent = Supervisor(home=homes[h], specs=[spec])
        agent.start()
        cleanups.append(agent.stop)
        deploy.agents[h] = agent
    deploy.observer = subprocess.Popen(
        hosts.argv("t1", [python, "-m", "tests.multihost_observer"]),
        env={k: v for k, v in envs["t1"].items() if not k.startswith("DARTBOARD_CPU_")},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    observer = deploy.observer
    cleanups.append(lambda: (observer.terminate(), observer.wait(10)))
    return deploy


def finished(state: dict[str, Any]) -> dict[int, str]:
    return {t["id"]: t["status"] for t in state["trajectories"]
            if t["status"] in ("succeeded", "failed")}  # fmt: skip


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_one_run_over_four_hosts_trains_and_outlives_a_killed_replica(tmp_path):
    with cluster(tmp_path) as deploy:
        run = deploy.ask(op="start", policy="shipped", set=SETTINGS, agents=True)["run"]

        # Placed over the four hosts, each doing what only it offers.
        state = deploy.wait(lambda s: s["status"] == "running", run, timeout=180,
                            what="the run placed and running")  # fmt: skip
        placement = state["placement"]
        names = {h: deploy.hosts.hostname(h) for h in AGENTS}
        assert placement["hosts"] == sorted(names.values())
        parts = {p["host"]: p for p in placement["plan"]["parts"]}
        assert parts[names["t1"]]["trainer_ranks"] == [0]
        assert parts[names["t2"]]["trainer_ranks"] == [1]
        rendezvous = parts[names["t1"]]["rendezvous"]
        assert rendezvous.startswith(f"{deploy.hosts.address('t1')}:")
        assert parts[names["t2"]]["rendezvous"] == rendezvous
        assert parts[names["inf"]]["inference_gpus"] == [None] and parts[names["inf"]]["router"]
        assert placement["router_url"].startswith(f"http://{deploy.hosts.address('inf')}:")
        assert parts[names["env"]]["env_workers"] == 2
        assert placement["host"] == names["inf"]

        # Versions trained by the two replicas, episodes from the env host.
        state = deploy.wait(lambda s: max(s["versions"], default=0) >= 1, run, timeout=300,
                            what="a version trained over t1 and t2")  # fmt: skip
        assert "trainer rank 1 of 2 joins" in deploy.log("t2", f"run-{run}-trainer-rank-1")
        assert {t["host"] for t in state["trajectories"]} == {names["env"]}

        # kill -9 of the second replica: that update ends, the agent on t2 starts the rank
        # again, it joins the leader's next group, and versions go on.
        namespace = deploy.hosts.namespace("t2")
        (pid,) = _pids_in(namespace, "workers.trainer_rank")
        before = finished(state)
        versions = state["versions"]
        os.kill(pid, signal.SIGKILL)
        state = deploy.wait(lambda s: max(s["versions"]) >= max(versions) + 2, run, timeout=400,
                            what="versions after the killed replica came back")  # fmt: skip
        assert _pids_in(namespace, "workers.trainer_rank") not in ([], [pid])
        assert deploy.log("t2", f"run-{run}-trainer-rank-1").count("trainer rank 1 of 2 joins") >= 2
        assert state["versions"] == list(range(state["versions"][0], state["versions"][-1] + 1))
        now = {t["id"]: t["status"] for t in state["trajectories"]}
        assert {k: now.get(k) for k in before} == before
        deploy.ask(op="stop", run=run)
