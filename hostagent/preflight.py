"""What `run_dartboard` checks before it starts anything: the Python version, the ports it
will listen on, free disk under DARTBOARD_HOME and available memory. Each problem is one
paragraph that says what is wrong and how to fix it (docs/troubleshooting.md lists them).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from core.procutil import pid_cmdline

MIN_PYTHON = (3, 11)
# The main job's processes (3 browsers, the trainer, an inference worker, web, Celery) take
# about 3 GiB on this project's 2-core machine; with the main job's version retention its
# home stays near 2 GB over 8 hours (docs/benchmarks.md).
MIN_MEMORY = 3 * 2**30
MIN_DISK = 3 * 2**30


@dataclass(frozen=True)
class Port:
    """A port the launcher will listen on, and the option that moves it."""

    host: str
    number: int
    what: str  # "the dashboard"
    option: str  # "--port"


def python_problem(version: Sequence[int] = tuple(sys.version_info[:3])) -> str | None:
    if tuple(version[:2]) >= MIN_PYTHON:
        return None
    found = ".".join(str(v) for v in version)
    return (
        f"Dartboard needs Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer; this is {found} "
        f"({sys.executable}). Install python3.11 (Debian 12: `apt-get install python3.11 "
        "python3.11-venv`), then `make clean` and `make run` again: the Makefile builds .venv "
        "with python3.11 when it is on the PATH."
    )


def port_holder(port: int) -> str:
    """Who listens on TCP `port` on this machine: "pid N (command line)", or "" when no
    process of ours can be named (another user's, or none)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                inodes.add(fields[9])
    if not inodes:
        return ""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                return f"pid {pid} ({pid_cmdline(int(pid)) or '?'})"
        except OSError:
            continue
    return ""


def bind_error(host: str, port: int) -> str | None:
    """Why `host`:`port` cannot be bound as a server binds it (SO_REUSEADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def port_free(port: int) -> bool:
    """No process listens on 127.0.0.1:`port`."""
    return bind_error("127.0.0.1", port) is None


def port_problem(port: Port) -> str | None:
    """Whether `port` can be bound; else who holds it and the option that moves it."""
    reason = bind_error(port.host, port.number)
    if reason is None:
        return None
    holder = port_holder(port.number)
    held = f" It is held by {holder}." if holder else ""
    return (
        f"Port {port.number} on {port.host}, for {port.what}, cannot be used: {reason}.{held} "
        f"Stop that process, or start on another port: `{port.option} N` "
        f"(`make run ARGS='{port.option} N'`)."
    )


def disk_problem(home: Path, *, need: int = MIN_DISK) -> str | None:
    where = home if home.exists() else home.parent
    free = shutil.disk_usage(where).free
    if free >= need:
        return None
    return (
        f"Only {free / 2**30:.1f} GiB are free under {where} (DARTBOARD_HOME is {home}); the "
        f"main job needs {need / 2**30:.0f} GiB to start, and keeping its newest versions its "
        "home stays near 2 GB over 8 hours (docs/benchmarks.md, *Disk over a long run*). Free "
        "some space, or set DARTBOARD_HOME to a larger disk."
    )


def memory_problem(*, need: int = MIN_MEMORY, meminfo: Path = Path("/proc/meminfo")) -> str | None:
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    if available >= need:
        return None
    return (
        f"Only {available / 2**30:.1f} GiB of memory are available; the main job needs about "
        f"{need / 2**30:.0f} GiB (three browsers, the trainer, an inference worker, the web "
        "and Celery), and every start asks for it. Stop other programs until `free -h` shows "
        f"{need / 2**30:.0f} GiB available, then start again."
    )


def preflight_problems(*, home: Path, ports: Sequence[Port]) -> list[str]:
    """Every problem that would stop the launcher, each one paragraph."""
    problems = [python_problem(), disk_problem(home), memory_problem()]
    problems += [port_problem(port) for port in ports]
    return [p for p in problems if p]
