"""The inference router in front of real inference worker processes on the tiny policy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from core.completion import Completion
from rollout import zygote
from rollout.auth import ADMIN_ENV, bearer, client_token
from rollout.client import PolicyClient, RouterAdmin, WorkerStatus
from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

AUTH = bearer(client_token(None))  # the test settings' inference token
ADMIN = bearer(client_token(None, ADMIN_ENV))  # and their admin token (/admin/*)
SERVER = [sys.executable, "-m", "rollout.server"]
MESSAGES = [{"role": "user", "content": "Click the submit button."}]


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_process(
    args: list[str], *, health_url: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`python -m *args` with this process's environment and `env` over it (an inference
    server forked from a zygote, as the launcher starts them)."""
    # stderr goes to a file: a pipe nobody reads would block a chatty server once full.
    log = tempfile.TemporaryFile()  # noqa: SIM115 - must outlive this function, like proc
    argv, environ = [sys.executable, "-m", *args], {**os.environ, **(env or {})}
    proc = zygote.popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, env=environ)
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(health_url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"{args[0]} did not start: {log.read().decode()[-2000:]}")
        time.sleep(0.2)


@dataclass
class Call:
    started: float
    finished: float
    completion: Completion


class ClientLoops:
    """`n` threads, each an episode-like loop of policy calls through the router."""

    def __init__(self, router: str, n: int = 4, *, max_tokens: int = 4):
        self.max_tokens = max_tokens
        self.calls: list[list[Call]] = [[] for _ in range(n)]
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(router, i)) for i in range(n)]

    def _loop(self, router: str, i: int) -> None:
        with PolicyClient(router, timeout=60) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    completion = client.complete(MESSAGES, max_tokens=self.max_tokens)
                except Exception as exc:
                    self.errors.append(exc)
                    continue
                self.calls[i].append(Call(started, time.monotonic(), completion))

    def __enter__(self) -> ClientLoops:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def all(self) -> list[Call]:
        return [c for calls in self.calls for c in calls]

    def each_has(self, n: int, *, after: float = 0.0) -> bool:
        return all(sum(c.started > after for c in calls) >= n for calls in self.calls)


def replay_active_counts(events: list[dict], *, since_seq: int) -> list[int]:
    """Active-worker count after every event from `since_seq` on, from the router's log."""
    status: dict[str, str] = {}
    counts = []
    for event in events:
        if event["status"] == "registered":
            status[event["worker"]] = "dead"
        elif event["status"] == "unregistered":
            status.pop(event["worker"], None)
        elif event["status"] not in ("swapped", "pull failed"):  # no change of status
            status[event["worker"]] = event["status"]
        if event["seq"] >= since_seq:
            counts.append(sum(s == "active" for s in status.values()))
    return counts


def test_weight_sync_under_load_loses_no_request_and_converges(cluster, checkpoints):
    admin = RouterAdmin(cluster.router)
    polls: list[tuple[float, dict]] = []
    with ClientLoops(cluster.router, n=4) as loops:
        wait_until(lambda: loops.each_has(1), what="first answers")
        seq_before = max(
            e["seq"] for e in httpx.get(f"{cluster.router}/admin/events", headers=ADMIN).json()
        )
        t_sync = time.monotonic()
        reply = admin.sync(str(checkpoints[1]), 1)
        assert reply["target_version"] == 1

        def converged() -> bool:
            health = admin.health()
            polls.append((time.monotonic(), health))
            return not health["syncing"] and all(
                w["status"] == "active" and w["policy_version"] == 1 for w in health["workers"]
            )

        wait_until(converged, timeout=90, what="both workers at v1")
        t_done = time.monotonic()
        wait_until(lambda: loops.each_has(2, after=t_done), what="answers after the sync")

    assert loops.errors == []
    calls = loops.all()
    assert {c.completion.policy_version for c in calls} == {0, 1}
    # Rollout never stopped: answers kept arriving while the workers were reloaded.
    assert any(t_sync < c.finished < t_done for c in calls)
    for client_calls in loops.calls:
        after = [c.completion.policy_version for c in client_calls if c.started > t_done]
        assert after and all(v == 1 for v in after)
    # Each step records the version that produced it: once a worker reports v1, every
    # request sent afterwards and answered by that worker says v1.
    for url in cluster.workers:
        at_v1 = min(
            t
            for t, h in polls
            if any(w["url"] == url and w["policy_version"] == 1 for w in h["workers"])
        )
        served = [c for c in calls if c.completion.served_by == url]
        assert served, f"{url} served nothing"
        assert all(c.completion.policy_version == 1 for c in served if c.started > at_v1)

    # Both workers active at every moment, by polling and by the router's log: a worker
    # that swaps live is drained by nobody.
    events = httpx.get(f"{cluster.router}/admin/events", headers=ADMIN).json()
    assert min(h["active"] for _, h in polls) == 2
    assert min(replay_active_counts(events, since_seq=seq_before + 1)) == 2
    reloaded = [e["worker"] for e in events if e["status"] == "swapped"]
    assert sorted(reloaded) == sorted(cluster.workers)  # each worker reloaded exactly once
    for url in cluster.workers:  # the workers themselves agree
        assert httpx.get(f"{url}/health").json()["policy_version"] == 1

    # The router never moves the policy backwards.
    r = httpx.post(
        f"{cluster.router}/admin/sync",
        headers=ADMIN,
        json={"checkpoint": str(checkpoints[0]), "version": 0},
    )
    assert r.status_code == 409
    assert r.json()["error"]["message"] == (
        "version 0 is older than version 1 already published: "
        "the router never moves the policy backwards"
    )
    admin.close()


def test_killing_a_worker_mid_run_loses_no_request(cluster):
    victim, survivor = cluster.workers
    victim_pid = httpx.get(f"{victim}/health").json()["pid"]
    admin = RouterAdmin(cluster.router)
    with ClientLoops(cluster.router, n=4) as loops:
        wait_until(lambda: all(w.served >= 2 for w in admin.workers()), what="both workers serving")
        os.kill(victim_pid, signal.SIGKILL)
        t_kill = time.monotonic()
        wait_until(lambda: loops.each_has(3, after=t_kill), what="answers after the kill")

    assert loops.errors == []
    # Sent after the kill: routed to the dead worker at first, maybe, but answered by the other.
    after = [c for c in loops.all() if c.started > t_kill]
    assert after and {c.completion.served_by for c in after} == {survivor}
    states = {w.url: w for w in admin.workers()}
    assert states[victim].status == WorkerStatus.DEAD
    assert states[victim].last_error  # the reason is on the worker row
    assert states[survivor].status == WorkerStatus.ACTIVE
    admin.close()


def test_single_worker_sync_fails_nothing_and_late_worker_joins_at_target(
    checkpoints,
):
    ports = [free_port(), free_port(), free_port()]
    first, late, router = (f"http://127.0.0.1:{p}" for p in ports)
    procs: list[subprocess.Popen] = []
    try:
        worker_args = ["--policy", str(checkpoints[0]), "--threads", "1"]
        procs.append(
            start_process(
                ["rollout.server", *worker_args, "--port", str(ports[0])],
                health_url=f"{first}/health",
            )
        )
        procs.append(
            start_process(
                ["rollout.router", "--port", str(ports[2]), "--worker", first],
                health_url=f"{router}/health",
            )
        )
        admin = RouterAdmin(router)
        with ClientLoops(router, n=2) as loops:
            wait_until(lambda: loops.each_has(1), what="first answers")
            admin.sync(str(checkpoints[1]), 1)
            admin.wait_for_version(1, timeout=60)
            t_done = time.monotonic()
            # A worker started later at v0 is reloaded to v1 before it serves anything.
            procs.append(
                start_process(
                    ["rollout.server", *worker_args, "--port", str(ports[1])],
                    health_url=f"{late}/health",
                )
            )
            assert admin.register(late).status not in (WorkerStatus.SUSPECT, WorkerStatus.DEAD)
            workers = admin.wait_for_version(1, timeout=60)
            assert {(w.url, w.policy_version, w.status) for w in workers} == {
                (first, 1, "active"),
                (late, 1, "active"),
            }
            t_joined = time.monotonic()
            wait_until(lambda: loops.each_has(2, after=t_joined), what="later answers")

        assert loops.errors == []  # the only worker served through its reload
        versions = [c.completion.policy_version for c in loops.all() if c.started > t_done]
        assert versions and set(versions) == {1}
        admin.unregister(late)
        assert [w.url for w in admin.workers()] == [first]
        admin.close()
    finally:
        for proc in procs:
            stop_process(proc)


def test_no_worker_answers_503_with_a_clear_message_after_the_wait_bound():
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    proc = start_process(
        ["rollout.router", "--port", str(port), "--wait-timeout", "1"],
        health_url=f"{router}/health",
    )
    try:
        body = {"messages": MESSAGES, "max_tokens": 4}
        started = time.monotonic()
        r = httpx.post(f"{router}/v1/chat/completions", headers=AUTH, json=body, timeout=30)
        assert 1.0 <= time.monotonic() - started < 5
        assert r.status_code == 503
        assert r.json()["error"]["message"] == (
            "no inference worker is registered (waited 1 s); "
            'register one with POST /admin/workers {"url": ...}'
        )

        dead = f"http://127.0.0.1:{free_port()}"
        with RouterAdmin(router) as admin:
            assert admin.register(dead).status == WorkerStatus.DEAD
        r = httpx.post(f"{router}/v1/chat/completions", headers=AUTH, json=body, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == (
            f"no active inference worker within 1 s ({dead} dead)"
        )
        # Open: up or down only; with a token, the workers and why they are out.
        assert httpx.get(f"{router}/health").json() == {"status": "down"}
        detailed = httpx.get(f"{router}/health", headers=AUTH).json()
        assert detailed["status"] == "unavailable" and detailed["workers"][0]["url"] == dead
    finally:
        stop_process(proc)


def test_all_at_once_sync_reloads_every_worker_and_a_new_run_starts_its_own_versions(
    cluster, checkpoints
):
    admin = RouterAdmin(cluster.router)
    # The synchronous baseline reloads every worker; workers that swap live are not
    # drained even there (a worker that cannot is: tests/rollout/test_router_drain.py).
    admin.sync(str(checkpoints[1]), 1, run=7, rolling=False)
    admin.wait_for_version(1, timeout=120)
    events = httpx.get(f"{cluster.router}/admin/events", headers=ADMIN).json()
    syncing = (WorkerStatus.DRAINING, WorkerStatus.LOADING)
    assert [e for e in events if e["status"] in syncing] == []
    assert sorted(e["worker"] for e in events if e["status"] == "swapped") == sorted(
        cluster.workers
    )
    # Within run 7 the policy never moves backwards...
    with pytest.raises(RuntimeError, match="never moves the policy backwards"):
        admin.sync(str(checkpoints[0]), 0, run=7)
    # ...but run 8 starts at its own version 0, and every worker loads its checkpoint.
    admin.sync(str(checkpoints[0]), 0, run=8)
    wait_until(
        lambda: all(w.policy_version == 0 and w.status == "active" for w in admin.workers()),
        timeout=120,
        what="both workers on run 8's v0",
    )
    with PolicyClient(cluster.router, timeout=60) as client:
        assert client.complete(MESSAGES, max_tokens=4).policy_version == 0
    admin.close()
