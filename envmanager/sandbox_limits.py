"""The resource side of the sandbox: a uid of its own per sandbox, its memory/pids cgroup,
and the task directory's tmpfs quota, plus the probe that tells a host which it cannot do.

A uid is leased with a flock on a root-only lock file (`UidLease`), so the kernel drops it
with its process; cgroups are named after that uid, so a group left by a killed worker is
emptied and reused by the uid's next lease; a task directory's tmpfs names its worker's pid
and start time, so the next sandbox unmounts those a killed worker left.

    lease = UidLease(); groups = sandbox_cgroups(uid=lease.uid, limits=SandboxLimits())
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dartboard.sandbox")

AGENT_UID_BASE = 640_000  # no passwd entries: these uids own nothing on the host but task dirs
AGENT_UID_COUNT = 4096  # sandboxes alive at once on one host
STATE_DIR = Path("/run/dartboard-sandbox")  # uid lease locks (root, 0700)
CGROUP_ROOT = Path("/sys/fs/cgroup")
ALLOW_UNLIMITED_ENV = "DARTBOARD_ALLOW_UNLIMITED_SANDBOX"
TASK_MOUNT_SOURCE = "dartboard-task"  # the tmpfs source name of task directories


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing, or the sandbox cannot be made as safe as it must be here."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox (a desktop's programs together, or one browser)."""

    memory_mb: int = 1536  # all programs of the sandbox together (cgroup)
    processes: int = 512  # RLIMIT_NPROC of the sandbox's own uid, and its cgroup's pids.max
    file_size_mb: int = 64  # RLIMIT_FSIZE: no single file larger
    tmp_mb: int = 256  # the tmpfs /tmp (chromium's shared memory lands there)
    home_mb: int = 64  # the tmpfs home
    task_dir_mb: int = 256  # the task directory's tmpfs on the host


def unlimited_allowed() -> bool:
    """Whether the admin lets sandboxes run without a memory/pids cgroup or task-dir quota."""
    return os.environ.get(ALLOW_UNLIMITED_ENV, "") == "1"


def host_limits_problem() -> str | None:
    """Why sandboxes on this host run without their memory/pids cgroup or task-directory
    quota, or None when both are enforced. With DARTBOARD_ALLOW_UNLIMITED_SANDBOX unset such a
    host refuses sandboxes instead; with it set, the slot records this and the host map shows
    it. Probes with a throwaway cgroup and tmpfs (a few ms; call it once per worker)."""
    problems = []
    probe = AGENT_UID_BASE + AGENT_UID_COUNT  # outside the leased range: no sandbox uses it
    try:
        for group in sandbox_cgroups(uid=probe, limits=SandboxLimits()):
            kill_and_remove(group)
    except SandboxUnavailable as exc:
        problems.append(str(exc).split(";")[0])
    with tempfile.TemporaryDirectory(prefix="dartboard-probe-") as tmp:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "dartboard-probe", tmp], capture_output=True
        )
        if done.returncode == 0:
            subprocess.run(["umount", tmp], capture_output=True)
        else:
            problems.append(f"no task-directory quota ({done.stderr.decode().strip()})")
    return "; ".join(problems) or None


class UidLease:
    """One uid of the sandbox range, held by this process until `release` (or its death:
    the lease is a flock on a root-only lock file, dropped by the kernel with the process).
    The descriptor stays open in exec'd children that inherit it (the browser launcher)."""

    def __init__(self) -> None:
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        if STATE_DIR.stat().st_uid != os.getuid():
            raise SandboxUnavailable(f"{STATE_DIR} is not owned by uid {os.getuid()}")
        start = os.getpid() % AGENT_UID_COUNT  # spread the search; any free uid will do
        for i in range(AGENT_UID_COUNT):
            uid = AGENT_UID_BASE + (start + i) % AGENT_UID_COUNT
            fd = os.open(STATE_DIR / f"uid-{uid}.lock", os.O_RDONLY | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self.fd = uid, fd
            return
        raise SandboxUnavailable(
            f"all {AGENT_UID_COUNT} sandbox uids from {AGENT_UID_BASE} are in use on this host"
        )

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def sandbox_cgroups(*, uid: int, limits: SandboxLimits) -> list[Path]:
    """The sandbox's memory and pids cgroups, beneath this process's own (cgroup v2, or v1's
    memory and pids hierarchies), named after its uid: a group left by a killed worker for
    the same uid is emptied and reused. Raises SandboxUnavailable when one cannot be made."""
    name = f"dartboard-sandbox-{uid}"
    memory, processes = str(limits.memory_mb * 1024 * 1024), str(limits.processes)
    base = CGROUP_ROOT
    own = _own_cgroups()
    if (base / "cgroup.controllers").exists():
        plan = [
            (base / own.get("", "/").lstrip("/"), {"memory.max": memory, "pids.max": processes})
        ]
    else:
        plan = [
            (
                base / "memory" / own.get("memory", "/").lstrip("/"),
                {"memory.limit_in_bytes": memory},
            ),
            (base / "pids" / own.get("pids", "/").lstrip("/"), {"pids.max": processes}),
        ]
    made: list[Path] = []
    for root, values in plan:
        group = root / name
        try:
            if group.is_dir():
                _kill_members(group)
            group.mkdir(exist_ok=True)
            for key, value in values.items():
                (group / key).write_text(value)
        except OSError as exc:
            for done in made:
                kill_and_remove(done)
            raise SandboxUnavailable(
                f"desktop sandbox: cannot create the memory/pids cgroup {group} ({exc}); "
                f"without it one desktop could exhaust the host's memory or processes. Run "
                f"the worker as root with cgroups writable, or the admin sets "
                f"{ALLOW_UNLIMITED_ENV}=1 to run without limits (the host map then says so)"
            ) from exc
        made.append(group)
    return made


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path ("" for the v2 unified hierarchy)."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            out[controller] = path
    return out


def _kill_members(group: Path) -> None:
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def kill_and_remove(group: Path) -> None:
    _kill_members(group)
    for _ in range(50):  # a killed process leaves its cgroup a moment later
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            threading.Event().wait(0.02)
    log.warning("desktop sandbox: cgroup %s still busy; left for the next lease of its uid", group)


def start_time(pid: int) -> str:
    """A process's start time in clock ticks (/proc/PID/stat field 22): with the pid it names
    one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[19]


def children(pid: int) -> list[tuple[int, str]]:
    """The children of `pid`, each with its start time (`start_time`): read before `pid` is
    killed, they can still be told apart once the kernel hands them to init."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append((int(entry), fields[19]))
    return found


def kill_same(processes: list[tuple[int, str]]) -> None:
    """SIGKILL each (pid, start time) that is still the process it names."""
    for pid, started in processes:
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def unmount_stale_task_dirs() -> None:
    """Unmount task-directory tmpfs mounts whose owning worker process is gone (a killed
    worker cannot unmount its own; the mount's source names its pid and start time)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if " - " not in line:
            continue
        after = line.split(" - ", 1)[1].split()
        if (
            len(after) < 2
            or after[0] != "tmpfs"
            or not after[1].startswith(TASK_MOUNT_SOURCE + "-")
        ):
            continue
        try:
            _, pid, start = after[1].rsplit("-", 2)
        except ValueError:
            continue
        if pid.isdigit() and start_time(int(pid)) == start:
            continue  # its worker is alive
        mount_point = fields[4].encode().decode("unicode_escape")
        subprocess.run(["umount", "--lazy", mount_point], capture_output=True)
        shutil.rmtree(Path(mount_point).parent, ignore_errors=True)
