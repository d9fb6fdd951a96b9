"""The single-machine launcher behind `make run`: embedded Redis, web, Celery workers.

Every child gets a parent-death signal, and their pids are kept in DARTBOARD_HOME/run/,
so a launcher killed with SIGKILL leaves nothing behind for long and a new launcher reaps
any survivor (only processes whose command line matches what we started). A child that
dies is restarted (with backoff); Ctrl-C or SIGTERM stops everything in order. The embedded
Redis is watched the same way: a dead redis-server is started again on the same socket with
its append-only file, and every worker reconnects by itself.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from core.procutil import die_with_parent, pid_cmdline, terminate_pid
from dartboard.embedded_redis import EmbeddedRedis, RedisStartError
from rollout.auth import TOKEN_ENV
from rollout.checkpoints import CACHE_ENV, STORE_ENV
from rollout.vllm_command import VLLM_ENV, vllm_serve_args

ROOT = str(Path(__file__).resolve().parent.parent)

log = logging.getLogger("dartboard.launcher")


@dataclass
class ProcSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class _Child:
    spec: ProcSpec
    proc: subprocess.Popen[bytes]
    started: float
    restarts: int = 0


class Supervisor:
    """Starts, watches and stops the stack's processes (and the embedded Redis, if given)."""

    def __init__(
        self, *, home: Path, specs: list[ProcSpec], redis: EmbeddedRedis | None = None
    ) -> None:
        self.home = home
        self.specs = specs
        self.redis = redis
        self.run_dir = home / "run"
        self.log_dir = home / "logs"
        self.pid_file = self.run_dir / "children.json"
        self.children: dict[str, _Child] = {}
        self._stopping = False

    def reap_stale(self) -> list[int]:
        """Stop children recorded by a previous launcher that was killed."""
        try:
            recorded = json.loads(self.pid_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return []
        reaped = []
        for item in recorded:
            cmd = pid_cmdline(int(item["pid"]))
            if cmd is not None and cmd == item["cmdline"]:
                terminate_pid(int(item["pid"]), timeout=10)
                reaped.append(int(item["pid"]))
        self.pid_file.unlink(missing_ok=True)
        return reaped

    def _record(self) -> None:
        items = []
        for child in self.children.values():
            cmd = pid_cmdline(child.proc.pid)
            if cmd:
                items.append({"name": child.spec.name, "pid": child.proc.pid, "cmdline": cmd})
        self.pid_file.write_text(json.dumps(items))

    def _spawn(self, spec: ProcSpec) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        logfile = open(self.log_dir / f"{spec.name}.log", "ab")  # noqa: SIM115  (owned by the child)
        env = {**os.environ, **spec.env}
        proc = subprocess.Popen(
            spec.argv,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with_parent,
        )
        logfile.close()
        return proc

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.specs:
            self.children[spec.name] = _Child(spec, self._spawn(spec), time.monotonic())
            log.info(
                "started %s (pid %d), log %s",
                spec.name,
                self.children[spec.name].proc.pid,
                self.log_dir / f"{spec.name}.log",
            )
        time.sleep(0.5)  # let argv settle (the pidfile records the command line)
        self._record()

    def watch_once(self) -> None:
        """Restart the embedded Redis if it died, and any child that exited (with a backoff
        of up to 30 s)."""
        if self.redis is not None and not self._stopping:
            self._watch_redis(self.redis)
        for name, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None or self._stopping:
                continue
            delay = min(30.0, 2.0**child.restarts)
            if time.monotonic() - child.started < delay:
                continue
            log.warning(
                "%s exited with %s; restarting (see %s)", name, code, self.log_dir / f"{name}.log"
            )
            child.proc = self._spawn(child.spec)
            child.started = time.monotonic()
            child.restarts += 1
            self._record()

    def _watch_redis(self, redis: EmbeddedRedis) -> None:
        code = redis.exited()
        if code is None:
            return
        log.warning("embedded Redis exited with %s; restarting it on %s (log %s)",
                    code, redis.socket_path, redis.logfile)  # fmt: skip
        try:
            redis.start()
        except RedisStartError as exc:  # tried again on the next watch
            log.error("embedded Redis did not restart: %s", exc)
        else:
            log.warning("embedded Redis is back on %s", redis.socket_path)

    def stop(self) -> None:
        """Celery workers first (their current episode or update still needs the inference
        service and the database), then everything else."""
        self._stopping = True
        workers = [c for c in self.children.values() if c.spec.name.startswith("worker-")]
        others = [c for c in self.children.values() if not c.spec.name.startswith("worker-")]
        for group in (workers, list(reversed(others))):
            for child in group:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60  # a trainer update or an episode may be finishing
            for child in group:
                try:
                    child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", child.spec.name)
                    child.proc.kill()
                    child.proc.wait()
        self.pid_file.unlink(missing_ok=True)
        if self.redis is not None:
            self.redis.stop()


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]


def default_specs(
    *,
    host: str,
    port: int,
    env_slots: int,
    inference_policy: str | None = None,
    inference_version: int = 0,
    inference_workers: int = 1,
    router_port: int = 8100,
    backend: str = "transformers",
) -> list[ProcSpec]:
    """web (daphne), Celery workers (default, train, one solo worker per env slot), Celery
    beat (the runs watchdog) and,
    with a policy, the rollout service: inference workers behind the router."""
    celery = [sys.executable, "-m", "celery", "-A", "dartboard", "worker", "--loglevel=INFO"]
    # The rollout service demands the token and loads weights only from these roots.
    # ... and fetches versions by reference from the artifact store into its cache.
    service_env = {
        "DARTBOARD_SERVICE_TOKEN": settings.DARTBOARD_SERVICE_TOKEN,
        "DARTBOARD_CHECKPOINT_ROOTS": os.pathsep.join(settings.DARTBOARD_CHECKPOINT_ROOTS),
        STORE_ENV: settings.DARTBOARD_ARTIFACTS,
        CACHE_ENV: str(settings.DARTBOARD_ARTIFACT_CACHE),
    }
    specs = [
        ProcSpec(
            "web",
            python_argv("-m", "daphne", "-b", host, "-p", str(port), "dartboard.asgi:application"),
        ),
        ProcSpec(
            "worker-default",
            [*celery, "-Q", "default", "--pool=threads", "--concurrency=4", "-n", "default@%h"],
        ),
        ProcSpec("worker-train", [*celery, "-Q", "train", "--pool=solo", "-n", "train@%h"]),
        # The runs watchdog (workers/watchdog.py): brings back the slot and trainer tasks
        # of a worker that died mid-task. The in-memory scheduler: nothing worth persisting.
        ProcSpec("beat", [*celery[:5], "beat", "-S", "celery.beat:Scheduler", "--loglevel=INFO"]),
    ]
    for i in range(env_slots):
        specs.append(
            ProcSpec(f"worker-env-{i}", [*celery, "-Q", "env", "--pool=solo", "-n", f"env{i}@%h"])
        )
    if inference_policy is not None:
        workers = []
        for i in range(inference_workers):
            wport = router_port + 1 + i
            workers.append(f"http://127.0.0.1:{wport}")
            if backend == "vllm":
                specs += vllm_specs(i, inference_policy, wport, router_port + 51 + i, service_env)
                continue
            specs.append(
                ProcSpec(
                    f"inference-{i}",
                    env=service_env,
                    argv=python_argv(
                        "-m",
                        "rollout.server",
                        "--policy",
                        inference_policy,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(wport),
                        "--version",
                        str(inference_version),
                        "--threads",
                        "1",
                    ),
                )
            )
        router = python_argv(
            "-m", "rollout.router", "--host", "127.0.0.1", "--port", str(router_port)
        )
        for url in workers:
            router += ["--worker", url]
        specs.append(ProcSpec("router", router, env=service_env))
    return specs


def vllm_specs(
    i: int, policy: str, port: int, vllm_port: int, service_env: dict[str, str]
) -> list[ProcSpec]:
    """vLLM on GPU i (on 127.0.0.1 only: its dev mode reloads weights) and the adapter that
    puts it behind the inference-worker contract on `port`. `policy` is the base checkpoint;
    the router's first sync loads the run's current version (an adapter, or full weights)."""
    args = vllm_serve_args(
        model_dir=policy, host="127.0.0.1", port=vllm_port, token=service_env[TOKEN_ENV]
    )
    vllm_env = {**service_env, **VLLM_ENV, "CUDA_VISIBLE_DEVICES": str(i), "PYTHONPATH": ROOT}
    adapter = python_argv(
        "-m", "rollout.vllm_adapter", "--vllm", f"http://127.0.0.1:{vllm_port}",
        "--policy-dir", policy, "--host", "127.0.0.1", "--port", str(port),
    )  # fmt: skip
    return [
        ProcSpec(f"vllm-{i}", python_argv("-m", "vllm.entrypoints.openai.api_server", *args),
                 env=vllm_env),
        ProcSpec(f"inference-{i}", adapter, env=service_env),
    ]  # fmt: skip


def wait_http(url: str, *, timeout: float) -> bool:
    """Poll `url` until it answers 200, up to `timeout` seconds."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False
