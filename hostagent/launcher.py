"""The single-machine launcher behind `make run`: embedded Redis, web, Celery workers.

Every child gets a parent-death signal, and their pids are kept in DARTBOARD_HOME/run/,
so a launcher killed with SIGKILL leaves nothing behind for long and a new launcher reaps
any survivor (only processes whose command line matches what we started). A child that
dies is restarted (with backoff); Ctrl-C or SIGTERM stops everything in order. The embedded
Redis is watched the same way: a dead redis-server is started again on the same socket with
its append-only file, and every worker reconnects by itself.

Secrets by need (rollout/auth.py): `prepare_home` sets a 077 umask and makes DARTBOARD_HOME
and its logs, pid file, database and secrets private (0700/0600, older ones fixed). The web,
the Celery workers and beat get the launcher's environment (they are configured by it); the
rollout service's processes get only what they read (`service_environ`): their own purpose's
tokens, never SECRET_KEY, DATABASE_URL, the master token or S3 write keys. vLLM takes its API
key from VLLM_API_KEY (no secret on any command line) and listens on a unix socket in the
0700 run/ directory, so its unauthenticated dev-mode routes answer only this user's adapter.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from core.procutil import die_with_parent, pid_cmdline, terminate_pid
from dartboard import config_env
from hostagent.embedded_redis import EmbeddedRedis, RedisStartError
from hostagent.preflight import port_free
from rollout import zygote
from rollout.auth import (
    READ_KEY_ENV,
    ROOTS_ENV,
    VLLM_KEY_ENV,
    ServiceTokens,
    service_environ,
)
from rollout.checkpoints import CACHE_ENV, STORE_ENV
from rollout.limits import SHARED, ServingLimits
from rollout.vllm_command import (
    checkpoint_dtype,
    vllm_cpu_build,
    vllm_environment,
    vllm_python,
    vllm_serve_args,
)

ROOT = str(Path(__file__).resolve().parent.parent)

log = logging.getLogger("hostagent.launcher")


PRIVATE_UMASK = 0o077  # files this user makes: 0600, directories 0700


def prepare_home(home: Path) -> None:
    """Before anything is written: a 077 umask (this process and every child it starts), and
    DARTBOARD_HOME's logs, run/, database and secrets private, older ones fixed."""
    os.umask(PRIVATE_UMASK)
    changed = config_env.home_make_private(home)
    if changed:
        log.warning("made private (others could read them): %s", ", ".join(map(str, changed)))


@dataclass
class ProcSpec:
    """One child. `env` is added to the launcher's environment when `inherit`, else it is the
    child's whole environment. `stale`: what a dead run of it may have left that would stop
    the next from starting (a unix socket), removed before each start. `port`: the TCP port
    it listens on, if any (`Supervisor.ports_taken`)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    inherit: bool = True
    stale: tuple[Path, ...] = ()
    port: int | None = None


STAYED_UP_S = 60.0  # a child that exits sooner failed at start (else it crashed while up)


@dataclass
class _Child:
    spec: ProcSpec
    proc: subprocess.Popen[bytes] | zygote.ZygoteChild
    started: float
    restarts: int = 0
    failed_starts: int = 0  # exits in a row, each within STAYED_UP_S of its start
    exited_at: float | None = None  # when it was first seen exited
    exit_code: int | None = None  # set when the supervisor gave up on it


@dataclass(frozen=True)
class GaveUp:
    """A child the supervisor stopped restarting: it failed at start too often."""

    name: str
    failed_starts: int
    exit_code: int
    log: Path
    last_line: str


class Supervisor:
    """Starts, watches and stops the stack's processes (and the embedded Redis, if given)."""

    def __init__(
        self,
        *,
        home: Path,
        specs: list[ProcSpec],
        redis: EmbeddedRedis | None = None,
        group: str = "children",
        give_up_after: int | None = None,
        first_backoff_s: float = 1.0,
    ) -> None:
        """group: names the pid file (DARTBOARD_HOME/run/<group>.json); a run's processes
        are a group of their own (`hostagent.agent`). give_up_after: a child that failed at
        start this many times in a row is not restarted again (`gave_up`); None: always
        restarted. A restart waits first_backoff_s, doubling with each, up to 30 s."""
        self.home = home
        self.specs = specs
        self.redis = redis
        self.run_dir = home / "run"
        self.log_dir = home / "logs"
        self.pid_file = self.run_dir / f"{group}.json"
        self.children: dict[str, _Child] = {}
        self._stopping = False
        self.give_up_after = give_up_after
        self.first_backoff_s = first_backoff_s

    def log_path(self, name: str) -> Path:
        """Where child `name` writes its output (appended to across its restarts)."""
        return self.log_dir / f"{name}.log"

    def reap_stale(self) -> list[int]:
        """Stop children recorded by a previous launcher that was killed: its own and every
        run group's (each group's pid file in run/)."""
        reaped = []
        for pid_file in [self.pid_file, *sorted(self.run_dir.glob("run-*.json"))]:
            try:
                recorded = json.loads(pid_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            for item in recorded:
                cmd = pid_cmdline(int(item["pid"]))
                if cmd is not None and cmd == item["cmdline"]:
                    terminate_pid(int(item["pid"]), timeout=10)
                    reaped.append(int(item["pid"]))
            pid_file.unlink(missing_ok=True)
        return reaped

    def _record(self) -> None:
        items = []
        for child in self.children.values():
            cmd = pid_cmdline(child.proc.pid)
            if cmd:
                items.append({"name": child.spec.name, "pid": child.proc.pid, "cmdline": cmd})
        # 0600 whatever the umask: command lines are nobody else's business.
        fd = os.open(self.pid_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(items))

    def _spawn(self, spec: ProcSpec) -> subprocess.Popen[bytes] | zygote.ZygoteChild:
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.log_path(spec.name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        logfile = os.fdopen(fd, "ab")  # owned by the child once started
        for path in spec.stale:
            path.unlink(missing_ok=True)
        env = {**os.environ, **spec.env} if spec.inherit else dict(spec.env)
        proc = zygote.popen(
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
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for spec in self.specs:
            self._start_child(spec)
        time.sleep(0.5)  # let argv settle (the pidfile records the command line)
        self._record()

    def _start_child(self, spec: ProcSpec) -> None:
        self.children[spec.name] = _Child(spec, self._spawn(spec), time.monotonic())
        log.info(
            "started %s (pid %d), log %s",
            spec.name,
            self.children[spec.name].proc.pid,
            self.log_path(spec.name),
        )

    def watch_once(self) -> None:
        """Restart the embedded Redis if it died, and any child that exited (with a backoff
        of up to 30 s)."""
        if self.redis is not None and not self._stopping:
            self._watch_redis(self.redis)
        for name, child in list(self.children.items()):
            code = child.proc.poll()
            if code is None or self._stopping or child.exit_code is not None:
                continue
            now = time.monotonic()
            if child.exited_at is None:  # seen exited for the first time (watched every tick)
                child.exited_at = now
            delay = min(30.0, self.first_backoff_s * 2.0**child.restarts)
            if now - child.started < delay:
                continue
            failed_start = child.exited_at - child.started < STAYED_UP_S
            child.failed_starts = child.failed_starts + 1 if failed_start else 0
            if self.give_up_after is not None and child.failed_starts >= self.give_up_after:
                child.exit_code = code
                log.error(
                    "%s failed at start %d times in a row (exit %s); not restarted (see %s)",
                    name,
                    child.failed_starts,
                    code,
                    self.log_path(name),
                )
                continue
            log.warning("%s exited with %s; restarting (see %s)", name, code, self.log_path(name))
            child.proc = self._spawn(child.spec)
            child.started, child.exited_at = time.monotonic(), None
            child.restarts += 1
            self._record()

    def gave_up(self) -> list[GaveUp]:
        """The children no longer restarted (`give_up_after`), with their logs' last line."""
        out = []
        for name, child in self.children.items():
            if child.exit_code is None:
                continue
            path = self.log_path(name)
            out.append(GaveUp(name, child.failed_starts, child.exit_code, path, _last_line(path)))
        return out

    def ports_taken(self) -> list[tuple[str, int]]:
        """(name, port) of each child that exited while another process holds its port:
        restarted there, it would only exit again."""
        return [
            (name, child.spec.port)
            for name, child in self.children.items()
            if child.spec.port is not None
            and child.proc.poll() is not None
            and not port_free(child.spec.port)
        ]

    def respec(self, specs: list[ProcSpec]) -> list[str]:
        """Take `specs` in place of the current ones: a child whose spec changed (or went) is
        stopped and the new one started; the others keep running. The names started."""
        new = {spec.name: spec for spec in specs}
        for name in [n for n, c in self.children.items() if new.get(n) != c.spec]:
            _end(self.children.pop(name))
        started = [spec for spec in specs if spec.name not in self.children]
        for spec in started:
            self._start_child(spec)
        self.specs = specs
        self._record()
        return [spec.name for spec in started]

    def _watch_redis(self, redis: EmbeddedRedis) -> None:
        code = redis.exited()
        if code is None:
            return
        log.warning(
            "embedded Redis exited with %s; restarting it on %s (log %s)",
            code,
            redis.socket_path,
            redis.logfile,
        )
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
        workers = [c for c in self.children.values() if "worker-" in c.spec.name]
        others = [c for c in self.children.values() if "worker-" not in c.spec.name]
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


def _last_line(path: Path, *, tail_bytes: int = 8192) -> str:
    """The last non-empty line of a log (its end only: logs grow)."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - tail_bytes))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")[:500]


def _end(child: _Child, timeout: float = 30.0) -> None:
    """SIGTERM one child, SIGKILL it after `timeout` seconds."""
    if child.proc.poll() is None:
        child.proc.send_signal(signal.SIGTERM)
    try:
        child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop in time; killing it", child.spec.name)
        child.proc.kill()
        child.proc.wait()


class Stopped(BaseException):
    """Ctrl-C or SIGTERM reached a launcher or an agent (`stop_on_signals`). A BaseException,
    as KeyboardInterrupt is: the signal lands wherever the main thread is, and a call that
    handles its own errors (`except Exception`: a router polled, a policy read) must not
    swallow it and leave the process running."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def stop_on_signals(on: bool = True) -> None:
    """SIGTERM and SIGINT raise `Stopped` (on), or are ignored (off: a second Ctrl-C must
    not interrupt the clean-up half way)."""
    handler = _raise_stopped if on else signal.SIG_IGN
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def python_argv(*args: str) -> list[str]:
    return [sys.executable, *args]


CELERY = [sys.executable, "-m", "celery", "-A", "dartboard", "worker", "--loglevel=INFO"]


def stack_specs(*, host: str, port: int) -> list[ProcSpec]:
    """What every launcher runs: web (`dartboard.serve`), the default Celery worker and Celery
    beat (the runs watchdog)."""
    return [
        ProcSpec("web", python_argv("-m", "dartboard.serve", "--host", host, "--port", str(port))),
        ProcSpec(
            "worker-default",
            [*CELERY, "-Q", "default", "--pool=threads", "--concurrency=4", "-n", "default@%h"],
        ),
        # The runs watchdog (workers/watchdog.py): brings back the slot and trainer tasks
        # of a worker that died mid-task. The in-memory scheduler: nothing worth persisting.
        ProcSpec("beat", [*CELERY[:5], "beat", "-S", "celery.beat:Scheduler", "--loglevel=INFO"]),
    ]


def env_worker_specs(
    count: int, *, queue: str = "env", prefix: str = "", first: int = 0
) -> list[ProcSpec]:
    """`count` solo Celery workers on an env queue, numbered from `first`: one env slot each."""
    tag = prefix.rstrip("-").replace("-", "")
    return [
        ProcSpec(
            f"{prefix}worker-env-{i}",
            [*CELERY, "-Q", queue, "--pool=solo", "-n", f"env{tag}-{i}@%h"],
        )
        for i in range(first, first + count)
    ]


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
    vllm_gpus: list[int] | None = None,
    vllm_gpu_memory: float | None = None,
) -> list[ProcSpec]:
    """The shared stack (DARTBOARD_PROCESSES=shared): `stack_specs`, the train worker, one
    solo worker per env slot and, with a policy, the rollout service: inference workers
    behind the router (vLLM worker i on `vllm_gpus[i]`, `rollout.vllm_command.vllm_gpus`)."""
    specs = [
        *stack_specs(host=host, port=port),
        ProcSpec("worker-train", [*CELERY, "-Q", "train", "--pool=solo", "-n", "train@%h"]),
        *env_worker_specs(env_slots),
    ]
    if inference_policy is not None:
        gpus: list[int | None] = (
            list(vllm_gpus) if backend == "vllm" and vllm_gpus else [None] * inference_workers
        )
        specs += serving_specs(
            policy=inference_policy,
            version=inference_version,
            backend=backend,
            router_port=router_port,
            worker_ports=[router_port + 1 + i for i in range(inference_workers)],
            gpus=gpus,
            vllm_gpu_memory=vllm_gpu_memory,
            # vLLM workers on a GPU host take their GPU from the list; the transformers
            # server of the shared stack runs on the CPU.
            device="cuda" if backend == "vllm" and vllm_gpus else "cpu",
        )
    return specs


def serving_specs(
    *,
    policy: str,
    version: int,
    backend: str,
    router_port: int,
    worker_ports: list[int],
    gpus: list[int | None],
    vllm_gpu_memory: float | None = None,
    device: str = "cpu",
    prefix: str = "",
    limits: ServingLimits | None = None,
    address: str = "127.0.0.1",
    first: int = 0,
    router: bool = True,
    router_workers: list[str] | None = None,
) -> list[ProcSpec]:
    """Inference workers (worker i on port `worker_ports[i]`, GPU `gpus[i]`, None: the CPU)
    behind a router on `router_port`, taking requests up to `limits` (a run's own: its
    budgets; None: the shared workers' defaults). `prefix` names a run's processes apart
    ("run-7-"). `address`: where they listen, the host's cluster address for a run whose
    other processes are on other hosts (DARTBOARD_HOST_ADDRESS). A run spread over hosts
    numbers its workers from `first` on this host; its router (`router`: on this host) sends
    to `router_workers`, every worker's URL on every host (None: these workers)."""
    if settings.DARTBOARD_ARTIFACTS.startswith("s3://") and not os.environ.get(READ_KEY_ENV):
        log.warning(
            "inference workers get the artifact store's own keys, which can write: "
            "set %s and its secret to a read-only pair",
            READ_KEY_ENV,
        )
    tokens = ServiceTokens(settings.DARTBOARD_INFERENCE_TOKEN, settings.DARTBOARD_ADMIN_TOKEN)
    specs: list[ProcSpec] = []
    for i, (wport, gpu) in enumerate(zip(worker_ports, gpus, strict=True)):
        if backend == "vllm":
            specs += vllm_specs(
                first + i,
                policy,
                wport,
                tokens=tokens,
                gpu=gpu,
                gpu_memory=vllm_gpu_memory if device == "cuda" else None,
                prefix=prefix,
                limits=limits,
                address=address,
            )
            continue
        env = inference_env(tokens)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        # Laid out by hand: each flag beside its values, as on the command line.
        argv = python_argv(
            "-m", "rollout.server", "--policy", policy, "--host", address,
            "--port", str(wport), "--version", str(version), "--threads", "1",
            "--device", "cuda" if gpu is not None else "cpu", *(limits or SHARED).server_args(),
        )  # fmt: skip
        specs.append(
            ProcSpec(f"{prefix}inference-{first + i}", argv, env=env, inherit=False, port=wport)
        )
    if not router:
        return specs
    argv = python_argv("-m", "rollout.router", "--host", address, "--port", str(router_port))
    if router_workers is None:
        router_workers = [f"http://{address}:{wport}" for wport in worker_ports]
    for url in router_workers:
        argv += ["--worker", url]
    router_argv = argv
    specs.append(
        ProcSpec(
            f"{prefix}router", router_argv, env=router_env(tokens), inherit=False, port=router_port
        )
    )
    return specs


def router_env(tokens: ServiceTokens) -> dict[str, str]:
    """The router's whole environment: its two tokens and the roots a sync may name."""
    return {
        **service_environ(os.environ),
        **tokens.environ(),
        "PYTHONPATH": ROOT,
        ROOTS_ENV: os.pathsep.join(settings.DARTBOARD_CHECKPOINT_ROOTS),
    }


def inference_env(tokens: ServiceTokens) -> dict[str, str]:
    """An inference worker's (or vLLM adapter's) whole environment: its tokens, the roots it
    loads from, the artifact store it fetches versions from (read keys only where the store
    is S3 and a read-only pair is configured) and its cache."""
    store = settings.DARTBOARD_ARTIFACTS
    return {
        **service_environ(os.environ, store=store),
        **tokens.environ(),
        "PYTHONPATH": ROOT,
        ROOTS_ENV: os.pathsep.join(settings.DARTBOARD_CHECKPOINT_ROOTS),
        STORE_ENV: store,
        CACHE_ENV: str(settings.DARTBOARD_ARTIFACT_CACHE),
    }


def vllm_socket(i: int, prefix: str = "") -> Path:
    """vLLM i's unix socket: in DARTBOARD_HOME/run/ (0700), so only this user connects."""
    return Path(settings.DARTBOARD_HOME) / "run" / f"{prefix}vllm-{i}.sock"


def vllm_specs(
    i: int,
    policy: str,
    port: int,
    *,
    tokens: ServiceTokens,
    gpu: int | None = None,
    gpu_memory: float | None = None,
    prefix: str = "",
    limits: ServingLimits | None = None,
    address: str = "127.0.0.1",
) -> list[ProcSpec]:
    """vLLM i (from its own environment, `vllm_python`) on `gpu` (default i) taking
    `gpu_memory` of it, or on the CPU with its CPU build, on a unix socket only this user can
    reach (its dev mode reloads weights from any path, with no key), and the adapter that
    puts it behind the inference-worker contract on `port`. The API key is a fresh one that
    only these two hold, in their environments. `policy` is the base checkpoint; the router's
    first sync loads the run's current version (an adapter, or full weights). `limits`: a
    run's (`ServingLimits.for_run`); None: the shared workers' defaults, and vLLM sizes its
    context from the model's own."""
    sock = vllm_socket(i, prefix)
    key = secrets.token_urlsafe(32)
    cpu_build = vllm_cpu_build()
    args = vllm_serve_args(
        model_dir=policy,
        uds=str(sock),
        gpu_memory=gpu_memory,
        dtype=checkpoint_dtype(policy),
        limits=limits,
        cpu_build=cpu_build,
    )
    vllm_env = {
        **service_environ(os.environ),
        # vLLM's own settings (VLLM_CPU_KVCACHE_SPACE, ...); the key is set below, not taken.
        **{k: v for k, v in os.environ.items() if k.startswith("VLLM_") and k != VLLM_KEY_ENV},
        **vllm_environment(api_key=key, cpu_build=cpu_build),
        "CUDA_VISIBLE_DEVICES": str(i if gpu is None else gpu),
    }
    vllm_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, on a CPU host (default 4)
    # Laid out by hand: each flag beside its values, as on the command line.
    adapter = python_argv(
        "-m", "rollout.vllm_adapter", "--vllm", f"unix:{sock}",
        "--policy-dir", policy, "--host", address, "--port", str(port),
        "--max-tokens-limit", str((limits or SHARED).max_new_tokens),
        "--max-images", str((limits or SHARED).max_images),
    )  # fmt: skip
    serve = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", *args]
    return [
        ProcSpec(f"{prefix}vllm-{i}", serve, env=vllm_env, inherit=False, stale=(sock,)),
        ProcSpec(
            f"{prefix}inference-{i}",
            adapter,
            env={**inference_env(tokens), VLLM_KEY_ENV: key},
            inherit=False,
            port=port,
        ),
    ]


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
