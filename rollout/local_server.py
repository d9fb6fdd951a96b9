"""Start a transformers inference server for one checkpoint as a child process (evaluation of
an arbitrary checkpoint, tests, benchmarks) and stop it again.

The child gets only what it needs (`rollout.auth.service_environ`): no database URL, secret
key, master token or S3 write keys of the process that starts it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from core.procutil import die_with_parent, terminate_pid
from rollout import zygote
from rollout.auth import ADMIN_ENV, INFERENCE_ENV, ServiceTokens, service_environ
from rollout.checkpoints import CACHE_ENV, STORE_ENV


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPolicyServer:
    """`with LocalPolicyServer(checkpoint) as url:` serves it on 127.0.0.1 until the block ends."""

    def __init__(
        self,
        checkpoint: Path,
        *,
        version: int = 0,
        threads: int = 1,
        log_path: Path | None = None,
        extra_args: list[str] | None = None,
        tokens: ServiceTokens | None = None,
    ) -> None:
        """`tokens`: what the server demands (default: DARTBOARD_INFERENCE_TOKEN and
        DARTBOARD_ADMIN_TOKEN when set, else a fresh pair only this object knows; clients
        find them in `self.tokens`)."""
        self.checkpoint = checkpoint
        self.version = version
        self.threads = threads
        self.log_path = log_path
        self.extra_args = extra_args or []
        self.tokens = tokens or _env_tokens() or ServiceTokens.fresh()
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | zygote.ZygoteChild | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> str:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        argv = [
            *(sys.executable, "-m", "rollout.server", "--policy", str(self.checkpoint)),
            *("--host", "127.0.0.1", "--port", str(self.port), "--version", str(self.version)),
            *("--threads", str(self.threads), *self.extra_args),
        ]
        env = {
            **service_environ(os.environ, store=os.environ.get(STORE_ENV)),
            **{k: os.environ[k] for k in (STORE_ENV, CACHE_ENV) if k in os.environ},
            INFERENCE_ENV: self.tokens.inference,
            ADMIN_ENV: self.tokens.admin,
        }
        self.proc = zygote.popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent
        )
        if not isinstance(log, int):
            log.close()  # the child has its own
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"inference server for {self.checkpoint} exited with {self.proc.returncode}"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise ServerStartError(
            f"inference server for {self.checkpoint} did not answer in {timeout:.0f} s"
        )

    def stop(self) -> None:
        if self.proc is not None:
            terminate_pid(self.proc.pid, timeout=10)
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _env_tokens() -> ServiceTokens | None:
    inference, admin = os.environ.get(INFERENCE_ENV), os.environ.get(ADMIN_ENV)
    return ServiceTokens(inference, admin) if inference and admin else None
