"""Private PostgreSQL and Redis servers that a test starts, stops and starts again (outage
tests). Each listens on 127.0.0.1 on a free port (and a unix socket in its own directory)
and is removed when the test ends, whatever happens."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_answering(
    url: str, proc: subprocess.Popen[bytes], *, what: str, timeout: float = 30
) -> None:
    """Poll `url` until it answers; RuntimeError with the process's stderr tail if the
    process exits first or `timeout` passes."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
                raise RuntimeError(f"{what} did not start: {err}") from None
            time.sleep(0.2)


def postgres_bindir() -> Path:
    """Debian's server binaries (apt `postgresql`, installed by `make test`)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise RuntimeError(
            "no PostgreSQL server binaries (initdb): install the apt package postgresql "
            "(make system-deps does)"
        )
    return Path(found[-1]).parent


class PrivatePostgres:
    """A throwaway PostgreSQL cluster (initdb + pg_ctl) with trust auth for user postgres.
    As root, its programs run as the `postgres` system user (initdb refuses root)."""

    def __init__(self) -> None:
        self.bindir = postgres_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="dartboard-pg-"))
        os.chmod(self.root, 0o755)
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.port = free_port()

    def _run(self, program: str, *args: str, timeout: float = 60) -> None:
        argv = [str(self.bindir / program), *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr[-2000:]}")

    def init(self) -> PrivatePostgres:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-sync")  # fmt: skip
        return self

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c max_connections=100"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options,
                  "-w", "start")  # fmt: skip

    def stop(self) -> None:
        """A fast shutdown: open connections are cut, as in a restart by an operator."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create_database(self, name: str) -> str:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def url(self, name: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{name}"

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateS3:
    """moto's S3 server (a real S3 API over HTTP) on 127.0.0.1, in its own process."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            wait_answering(f"{self.url}/moto-api/", self.proc, what="moto's S3 server")
        except RuntimeError:
            self.stop()
            raise

    def env(self) -> dict[str, str]:
        """What a client process needs to reach it."""
        return {
            "AWS_S3_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "dartboard-test",
            "AWS_SECRET_ACCESS_KEY": "dartboard-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self):
        import boto3

        env = self.env()
        return boto3.client(
            "s3",
            endpoint_url=env["AWS_S3_ENDPOINT_URL"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
