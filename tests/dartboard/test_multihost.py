"""Dartboard on three hosts that share nothing but PostgreSQL, Redis and an S3 server.

Each host is a Linux network namespace of the test's own (tests/netns.py) with its own
hostname and its own DARTBOARD_HOME, and no directory in common:
- host "svc": PostgreSQL, Redis (with a password) and moto's S3 server, listening only on
  its veth address;
- host A: the web (`dartboard.serve`), the default and train workers and Celery beat (the watchdog);
- host B: two env workers (real chromium, MiniWoB++);
- host C: the router, and an inference worker that registers itself with it.

Screenshots go to the bucket, published versions go to the artifact store in the bucket and
host C fetches them from there. A short real run must show trajectories recorded from host B,
a version trained on A served on C, the env wall (fetched from the web on A) showing B's
slots, and a `kill -9` of a B worker recovered. Everything the test made is removed, even
when it fails.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from core.prompt_counter import COUNTER_FILES
from datamanager.policies import SHIPPED_POLICY
from hostagent.launcher import ProcSpec, Supervisor, default_specs
from rollout.auth import ServiceTokens
from tests import netns
from tests.live_stack import FAST_LIVENESS
from tests.private_services import PrivateS3, services_host

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "dartboard"
A_SERVICES = ("worker-default", "worker-train", "beat")
B_SERVICES = ("worker-env-0", "worker-env-1")


@dataclass
class Deployment:
    hosts: netns.VirtualHosts
    homes: dict[str, Path]
    env: dict[str, dict[str, str]]
    s3: PrivateS3 | None = None
    supervisors: dict[str, Supervisor] = field(default_factory=dict)
    observer: subprocess.Popen[str] | None = None
    run: int | None = None
    policy: str = ""  # the base model's artifact reference

    def ask(self, **request: Any) -> dict[str, Any]:
        reply = self._ask(**request)
        assert "error" not in reply, reply["error"]
        return reply

    def _ask(self, **request: Any) -> dict[str, Any]:
        assert self.observer is not None and self.observer.stdin and self.observer.stdout
        self.observer.stdin.write(json.dumps(request) + "\n")
        self.observer.stdin.flush()
        return json.loads(self.observer.stdout.readline() or '{"error": "observer exited"}')

    def wait(self, pred: Callable[[dict[str, Any]], Any], run: int, *, timeout: float, what: str):
        """Poll the run's state until `pred` holds, while each host's supervisor restarts
        what died (as an init system or compose would)."""
        deadline = time.monotonic() + timeout
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            for supervisor in self.supervisors.values():
                supervisor.watch_once()
            # One slow answer (the web on a loaded machine) is asked again; the last error
            # is in the failure when nothing ever answers.
            reply = self._ask(op="state", run=run)
            if "error" in reply:
                state = {**state, "last error": reply["error"]}
            else:
                state = reply
                if pred(state):
                    return state
            time.sleep(2)
        summary = {k: v for k, v in state.items() if k != "wall"}
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; logs under "
                             f"{', '.join(map(str, self.homes.values()))}; last state {summary}")  # fmt: skip


def host_env(hosts: netns.VirtualHosts, host: str, home: Path, **extra: str) -> dict[str, str]:
    """A host's whole configuration: the three shared services by their veth addresses and
    nothing of this test process's own (its database, Redis, home)."""
    own = ("DARTBOARD_", "DATABASE_URL", "REDIS_URL", "TEST_", "AWS_", "DJANGO_", "ALLOWED_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    svc = hosts.address("svc")
    if "c" in hosts.hosts:  # the shared rollout service, on host C
        env["DARTBOARD_INFERENCE_URLS"] = f"http://{hosts.address('c')}:8100"
    return {
        **env,
        **FAST_LIVENESS,
        "DJANGO_SETTINGS_MODULE": "dartboard.settings",
        "DARTBOARD_HOME": str(home),
        "DARTBOARD_ARTIFACT_CACHE": str(home / "artifact-cache"),
        "DATABASE_URL": f"postgres://postgres@{svc}:5432/dartboard",
        "DARTBOARD_S3_BUCKET": BUCKET,
        "DARTBOARD_ARTIFACTS": f"s3://{BUCKET}/artifacts",
        "AWS_S3_ENDPOINT_URL": f"http://{svc}:9000",
        "AWS_ACCESS_KEY_ID": "dartboard-test",
        "AWS_SECRET_ACCESS_KEY": "dartboard-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "PYTHONPATH": str(ROOT),
        **extra,
    }


def services_on(hosts: netns.VirtualHosts, host: str, specs: list[ProcSpec], env: dict[str, str]):
    for spec in specs:
        spec.argv = hosts.argv(host, spec.argv)
        spec.env = env
    return specs


@contextlib.contextmanager
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    hosts = netns.VirtualHosts(["svc", "a", "b", "c"])
    cleanups: list[Callable[[], None]] = [hosts.remove]
    try:
        hosts.create()
        yield from _deploy(hosts, tmp_path, cleanups)
    finally:
        for cleanup in reversed(cleanups):  # last made, first removed; every one is tried
            with contextlib.suppress(Exception):
                cleanup()


def _deploy(hosts: netns.VirtualHosts, tmp_path: Path, cleanups: list) -> Iterator[Deployment]:
    svc, a, c = hosts.address("svc"), hosts.address("a"), hosts.address("c")
    on_svc = lambda argv: hosts.argv("svc", argv)  # noqa: E731

    services = services_host(address=svc, wrap=on_svc, redis_dir=tmp_path / "svc-redis",
                             cleanups=cleanups, buckets=(BUCKET,))  # fmt: skip  # one call
    assert services.s3 is not None
    s3 = services.s3
    for port in (5432, 6379, 9000):
        hosts.wait_tcp("a", svc, port)

    token = secrets.token_urlsafe(32)
    homes = {h: tmp_path / f"home-{h}" for h in ("a", "b", "c")}
    common = {
        "REDIS_URL": services.redis_url,
        "DARTBOARD_SERVICE_TOKEN": token,
        **ServiceTokens.derived(token).environ(),  # the router and inference worker read these
    }
    env = {
        "a": host_env(hosts, "a", homes["a"], ALLOWED_HOSTS=a, **common),
        "b": host_env(hosts, "b", homes["b"], **common),
        "c": host_env(hosts, "c", homes["c"], **common),
    }
    # The operator's one-shots, from host A: the schema, and the base model into the store
    # (the bucket is the S3 server's own). The run trains that reference.
    python = sys.executable
    hosts.run("a", [python, "manage.py", "migrate", "--no-input"], env=env["a"], timeout=300)
    publish = [python, "manage.py", "publish_policy", str(SHIPPED_POLICY)]
    policy = hosts.run("a", publish, env=env["a"]).strip().splitlines()[-1]

    stack = default_specs(host=a, port=8000, env_slots=2)  # no policy: no inference specs
    inference = [python, "-m", "rollout.server", "--policy", policy,
                 "--host", c, "--port", "8101", "--threads", "1",
                 "--register", f"http://{c}:8100", "--register-every", "5"]  # fmt: skip
    specs = {
        "a": [s for s in stack if s.name in ("web", *A_SERVICES)],
        "b": [s for s in stack if s.name in B_SERVICES],
        "c": [
            ProcSpec("router", [python, "-m", "rollout.router", "--host", c, "--port", "8100"]),
            ProcSpec("inference-0", inference),
        ],
    }
    deploy = Deployment(hosts=hosts, homes=homes, env=env, s3=s3, policy=policy)
    for host in ("c", "a", "b"):  # the rollout service first: workers call it
        supervisor = Supervisor(
            home=homes[host], specs=services_on(hosts, host, specs[host], env[host])
        )
        supervisor.start()
        cleanups.append(supervisor.stop)
        deploy.supervisors[host] = supervisor
    hosts.wait_tcp("a", c, 8100, timeout=120)
    hosts.wait_tcp("b", a, 8000, timeout=120)
    deploy.observer = subprocess.Popen(
        hosts.argv("a", [python, "-m", "tests.multihost_observer"]),
        env={**env["a"], "MULTIHOST_WEB": f"http://{a}:8000"},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    observer = deploy.observer
    cleanups.append(lambda: (observer.terminate(), observer.wait(10)))
    # Stopping the run first lets the trainer's loop end before its worker is stopped.
    cleanups.append(lambda: deploy.run and deploy.ask(op="stop", run=deploy.run))
    yield deploy


def finished(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in state["trajectories"] if t["status"] in ("succeeded", "failed")]


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_three_hosts_sharing_only_the_services_train_and_recover(tmp_path):
    """One deployment, checked stage by stage (long: the stages share it, and a deployment
    of three hosts costs a minute to bring up)."""
    with deployment(tmp_path) as deploy:
        run = deploy.run = deploy.ask(op="start", policy=deploy.policy)["run"]

        # A version trained on A, published through the bucket, served on C, and
        # episodes of host B sampled from it.
        def trained_and_served(state: dict[str, Any]) -> bool:
            served = [w for w in state["router_workers"] if (w["policy_version"] or 0) >= 1]
            sampled = [t for t in finished(state) if any(v >= 1 for v in t["versions"])]
            return bool(served and sampled)

        state = deploy.wait(trained_and_served, run, timeout=420,
                            what="a version trained on A, served on C, sampled on B")  # fmt: skip
        c = deploy.hosts.address("c")
        assert [w["url"] for w in state["router_workers"]] == [f"http://{c}:8101"]
        version = state["versions"][-1]
        assert version["version"] >= 1 and version["artifact"].startswith("artifact:runs/")
        # Host C verified and cached the version it fetched from the bucket; no host holds
        # a screenshot (they are in the bucket) and B and C hold no checkpoint of A's.
        # The base model reached every host through the store: A's trainer fetched it whole,
        # C's inference worker started from it, B's env workers took only its image geometry.
        fetched = {h: [p.name for p in files_under(deploy.homes[h] / "artifact-cache")]
                   for h in ("a", "b", "c")}  # fmt: skip
        assert deploy.policy.startswith("artifact:policies/tiny-grounded-")
        assert "model.safetensors" in fetched["a"]
        assert "model.safetensors" in fetched["c"]
        assert "trainer_state.pt" not in fetched["c"]  # a version's optimizer state: the trainer's
        # B's env workers: what they measure prompts with, the processor's and tokenizer's
        # files (core.prompt_counter.COUNTER_FILES), never the weights.
        assert "model.safetensors" not in fetched["b"]
        assert set(fetched["b"]) == {"MANIFEST.json"} | (COUNTER_FILES & set(fetched["a"]))
        assert files_under(deploy.homes["a"] / "checkpoints")
        assert not files_under(deploy.homes["b"] / "checkpoints")
        assert not files_under(deploy.homes["c"] / "checkpoints")
        for home in deploy.homes.values():
            assert not files_under(home / "media")

        # Every trajectory came from host B's two slots; the web on A shows them on the wall.
        assert {t["host"] for t in state["trajectories"]} == {"host-b"}
        assert state["page_status"] == 200 and state["wall_status"] == 200
        wall = {tile["name"].split(":", 2)[-1] for tile in state["wall"]}
        assert wall == {"miniwob:0", "miniwob:1"}
        assert all(tile["name"].startswith("host-b:") for tile in state["wall"])

        # kill -9 of a B worker in the middle of an episode: its episode is ended, the
        # worker comes back (B's supervisor), the watchdog on A gives it its slot again.
        running = deploy.wait(
            lambda s: [t for t in s["trajectories"] if t["status"] == "running" and t["steps"]],
            run, timeout=120, what="an episode under way on B",
        )  # fmt: skip
        victim = next(t for t in running["trajectories"] if t["status"] == "running")
        pid = int(victim["slot"].split(":")[1])
        os.kill(pid, signal.SIGKILL)
        killed_at = max(t["id"] for t in running["trajectories"])

        def recovered(s: dict[str, Any]) -> bool:
            after = [t for t in finished(s) if t["id"] > killed_at]
            slot = victim["slot"].split(":", 2)[-1]
            again = [t for t in after if t["slot"].endswith(slot) and f":{pid}:" not in t["slot"]]
            ended = next(t for t in s["trajectories"] if t["id"] == victim["id"])
            return bool(again) and ended["status"] != "running"

        state = deploy.wait(
            recovered, run, timeout=240, what="the killed B worker's slot served again"
        )
        # Its episode ended with the reason, unless it had just finished before the kill.
        ended = next(t for t in state["trajectories"] if t["id"] == victim["id"])
        assert ended["status"] in ("succeeded", "failed") or ended["error"], ended
        # Every finished trajectory of before the kill is still there, finished.
        before = {t["id"]: t["status"] for t in finished(running)}
        now = {t["id"]: t["status"] for t in state["trajectories"]}
        assert {k: now.get(k) for k in before} == before

        # The S3 server restarts mid-run (stopped for 12 s; moto keeps nothing, so it comes
        # back with its bucket but none of the objects). Steps wait it out: no episode
        # ends in error, no slot is counted failing, and the trainer publishes through it,
        # leaving out what it can no longer read.
        assert deploy.s3 is not None
        before = {t["id"]: t["status"] for t in finished(state)}
        versions = state["versions"][-1]["version"]
        deploy.s3.stop()
        time.sleep(12)
        deploy.s3.start()
        deploy.hosts.wait_tcp("a", deploy.hosts.address("svc"), 9000)
        # Episodes begun up to now may have stored screenshots in the store that was lost
        # (one can start between the last state read and the stop): read the ids again.
        back = max(t["id"] for t in deploy.ask(op="state", run=run)["trajectories"])

        def through(s: dict[str, Any]) -> bool:
            later = [t for t in finished(s) if t["id"] > back]
            newer = [v for v in s["versions"] if v["version"] > versions]
            return len(later) >= 2 and bool(newer)

        state = deploy.wait(
            through, run, timeout=240, what="episodes and a version after S3 came back"
        )
        assert [t for t in state["trajectories"] if t["status"] == "error"] == []
        # What the empty store lost (screenshots of steps from before it restarted) is left
        # out of training with the reason; nothing recorded after it came back is.
        left_out = [t["id"] for t in state["trajectories"] if "missing from storage" in t["error"]]
        assert all(pk <= back for pk in left_out)
        now = {t["id"]: t["status"] for t in state["trajectories"]}
        assert {k: now.get(k) for k in before} == before
        assert all(tile["status"] != "quarantined" for tile in state["wall"])
