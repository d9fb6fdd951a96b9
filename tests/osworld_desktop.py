"""A Dartboard desktop serving OSWorld's protocol (envmanager.osworld_server) in its own
process, for the tests: `with desktop_server(token=...) as server: server.address`.

Its environment carries a planted secret (SECRET_KEY, DATABASE_URL) the way a worker's
does, so tests can check that nothing the server runs can see it. Stopped (SIGTERM, then
SIGKILL) by its PID when the block ends; the server stops its own Xvfb and apps.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANTED_SECRET = "planted-secret-8d1f0c"


@dataclass(frozen=True)
class DesktopServer:
    address: str  # host:port
    token: str
    pid: int

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def vm_ip(self) -> str:
        """What OSWorld's controllers take as vm_ip: the token rides as Basic auth."""
        return f"dartboard:{self.token}@{self.host}"


@contextlib.contextmanager
def desktop_server(*, token: str, port: int = 0) -> Iterator[DesktopServer]:
    """`token`: the desktop's own (the workers derive one per address: pick `port` first)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(ROOT),
        "DARTBOARD_DESKTOP_TOKEN": token,
        "SECRET_KEY": PLANTED_SECRET,
        "DATABASE_URL": f"postgres://dartboard:{PLANTED_SECRET}@127.0.0.1/dartboard",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "envmanager.osworld_server", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if " on " not in line:
            raise RuntimeError(f"the desktop server did not start (said {line!r})")
        address = line.split(" on ")[1].split()[0]
        yield DesktopServer(address=address, token=token, pid=proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
