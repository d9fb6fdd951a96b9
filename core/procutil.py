"""Process helpers shared by the launcher and the tests (Linux)."""

from __future__ import annotations

import ctypes
import os
import signal
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies, even by SIGKILL."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def pid_cmdline(pid: int) -> str | None:
    """The command line of a live process, or None if there is none (or it is a zombie)."""
    try:
        raw = open(f"/proc/{pid}/cmdline", "rb").read()  # noqa: SIM115
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    if not raw:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def terminate_pid(pid: int, *, timeout: float) -> None:
    """SIGTERM, then SIGKILL after `timeout`. Only call it on processes we started."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_cmdline(pid) is None:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
