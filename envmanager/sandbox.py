"""The sandbox every program the policy drives runs in: bubblewrap under an unprivileged uid.

The policy's text becomes keystrokes in a shell, an editor, a browser. Those programs run
under `bwrap` (Debian's bubblewrap) as uid/gid AGENT_UID, in their own user, pid, ipc, uts,
cgroup and network namespaces. What a sandboxed program sees:

- /usr read-only, and from /etc only what programs need to start (fonts, the loader cache,
  X11 and chromium configuration, alternatives);
- its own /proc and /dev, a tmpfs /tmp, a tmpfs home (/home/agent);
- the task directory at /home/agent/task (read-write: the only thing that outlives it);
- the X display's socket, and the environment DISPLAY, HOME, PATH, LANG and nothing else.

Not: the network (an empty network namespace: no route, no DNS), DARTBOARD_HOME, the
checkout and its virtual environment, the worker's environment (SECRET_KEY, DATABASE_URL,
REDIS_URL, S3 keys), other processes. Limits: RLIMIT_FSIZE and RLIMIT_NPROC always; memory
and process count per desktop through a cgroup when the host lets this process create one
(cgroup v1 memory/pids or cgroup v2), said in the log once when it cannot.

    sandbox = Sandbox(task_dir=Path("/tmp/x/task"), display=":7")
    proc = sandbox.popen(["xterm", "-e", "bash"])
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import signal
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.procutil import die_with_parent

log = logging.getLogger("dartboard.sandbox")

AGENT_UID = AGENT_GID = 64999  # no passwd entry: owns nothing on the host but task dirs
HOME = "/home/agent"
TASK_DIR = f"{HOME}/task"
AGENT_PATH = "/usr/bin:/bin"
AGENT_PYTHON = "/usr/bin/python3"  # Debian's, with python3-tk; never the checkout's venv
ETC_ENTRIES = (
    "fonts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "X11",
    "chromium",
    "chromium.d",
    "localtime",
    "mime.types",
)


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces here."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one desktop's sandboxed programs."""

    memory_mb: int = 1536  # all programs of the desktop together (cgroup)
    processes: int = 512  # RLIMIT_NPROC of the agent uid, and pids.max of the desktop
    file_size_mb: int = 64  # RLIMIT_FSIZE: no single file larger


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: `make install` installs Debian's bubblewrap"
        )
    return path


class Sandbox:
    """The sandbox of one desktop: its task directory, display and resource limits."""

    def __init__(
        self,
        *,
        task_dir: Path,
        display: str,
        limits: SandboxLimits = SandboxLimits(),
        mount_at: str = TASK_DIR,
        home: str = HOME,
        ro_binds: tuple[tuple[str, str], ...] = (),
        extra_env: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """mount_at: where the task directory appears inside (an OSWorld-protocol desktop
        mounts it as the whole home, /home/user); home: $HOME inside; ro_binds: more
        read-only (host, inside) mounts, e.g. the sandbox's pyautogui; extra_env: more
        variables of the clean environment (never the worker's)."""
        self.task_dir = task_dir
        self.display = display
        self.limits = limits
        self.mount_at = mount_at
        self.home = home
        self.ro_binds = ro_binds
        self.extra_env = extra_env
        self._cgroups = _make_cgroups(limits)

    def prepare_task_dir(self) -> None:
        """The task directory, empty and owned by the agent uid. Its parent stays root's
        (mode 0711), so the agent can change what is inside but not swap the directory."""
        shutil.rmtree(self.task_dir, ignore_errors=True)
        self.task_dir.mkdir(parents=True)
        os.chmod(self.task_dir.parent, 0o711)
        os.chown(self.task_dir, AGENT_UID, AGENT_GID)

    def write_file(self, name: str, content: str) -> None:
        """A fixture file of the task's setup, owned by the agent."""
        path = self.task_dir / name
        path.write_text(content)
        os.chown(path, AGENT_UID, AGENT_GID)

    def environ(self) -> dict[str, str]:
        return {
            "DISPLAY": self.display,
            "HOME": self.home,
            "PATH": AGENT_PATH,
            "LANG": "C.UTF-8",
            **dict(self.extra_env),
        }

    def argv(self, program: list[str]) -> list[str]:
        """The bwrap command line that runs `program` (paths as the sandbox sees them)."""
        number = self.display.lstrip(":").split(".")[0]
        x_socket = f"/tmp/.X11-unix/X{number}"
        return bwrap_argv(
            program,
            env=self.environ(),
            binds=[(str(self.task_dir), self.mount_at)],
            ro_binds=[(x_socket, x_socket), *self.ro_binds],
            chdir=self.mount_at,
        )

    def popen(self, program: list[str]) -> subprocess.Popen:
        """Start `program` in the sandbox, in its own process group (stopped by killpg)."""
        return subprocess.Popen(
            self.argv(program),
            env={},
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=self._drop_privileges(),
        )

    def run(
        self, program: list[str], *, timeout_s: float, stdin: bytes | None = None
    ) -> subprocess.CompletedProcess:
        """Run `program` in the sandbox to completion, `stdin` fed to it; raises
        subprocess.TimeoutExpired after `timeout_s` (its process group is killed first)."""
        proc = subprocess.Popen(
            self.argv(program),
            env={},
            cwd="/",
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=self._drop_privileges(),
        )
        try:
            out, err = proc.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # a program that forked survives kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        """Remove the desktop's cgroups (their processes have been stopped)."""
        for group in self._cgroups:
            with contextlib.suppress(OSError):
                group.rmdir()
        self._cgroups = []

    def _drop_privileges(self) -> Callable[[], None]:
        limits, cgroups = self.limits, list(self._cgroups)
        return lambda: drop_privileges(limits, cgroups)  # in the child, between fork and exec


def bwrap_argv(
    program: list[str],
    *,
    env: dict[str, str],
    binds: list[tuple[str, str]],
    ro_binds: list[tuple[str, str]],
    chdir: str,
) -> list[str]:
    """bwrap with every namespace unshared (no network), a clean environment `env`, /usr and
    a few /etc entries read-only, its own /proc, /dev and tmpfs /tmp and home, plus `binds`
    (read-write) and `ro_binds`, each (host path, sandbox path)."""
    args = [
        bwrap_path(),
        "--unshare-all",  # user, pid, ipc, uts, cgroup and network namespaces
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        *[a for k, v in env.items() for a in ("--setenv", k, v)],
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--symlink", "usr/sbin", "/sbin",
    ]  # fmt: skip
    for entry in ETC_ENTRIES:
        if os.path.lexists(f"/etc/{entry}"):
            args += ["--ro-bind", f"/etc/{entry}", f"/etc/{entry}"]
    # The font cache: without it every app start rebuilds it (measured +280 ms a reset).
    if os.path.isdir("/var/cache/fontconfig"):
        args += ["--ro-bind", "/var/cache/fontconfig", "/var/cache/fontconfig"]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", HOME]
    for host, inside in binds:
        args += ["--bind", host, inside]
    for host, inside in ro_binds:
        args += ["--ro-bind", host, inside]
    return [*args, "--chdir", chdir, "--", *program]


def drop_privileges(limits: SandboxLimits, cgroups: list[Path]) -> None:
    """Join the cgroups, set the limits and become the agent uid (in a child before exec)."""
    for group in cgroups:
        (group / "cgroup.procs").write_text(str(os.getpid()))
    file_size = limits.file_size_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setgroups([])
    os.setgid(AGENT_GID)
    os.setuid(AGENT_UID)
    die_with_parent()  # after setuid: a credential change clears the death signal


_warned_no_cgroup = False


def _make_cgroups(limits: SandboxLimits) -> list[Path]:
    """Per-desktop cgroups holding the memory and process limits, where the host allows
    this process to create them (cgroup v2, or v1's memory and pids hierarchies)."""
    global _warned_no_cgroup
    name = f"dartboard-desktop-{uuid.uuid4().hex[:12]}"
    memory, processes = str(limits.memory_mb * 1024 * 1024), str(limits.processes)
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        plan = [(base, {"memory.max": memory, "pids.max": processes})]
    else:
        plan = [
            (base / "memory", {"memory.limit_in_bytes": memory}),
            (base / "pids", {"pids.max": processes}),
        ]
    made: list[Path] = []
    for root, values in plan:
        group = root / name
        try:
            group.mkdir()
            for key, value in values.items():
                (group / key).write_text(value)
        except OSError as exc:
            with contextlib.suppress(OSError):
                group.rmdir()
            if not _warned_no_cgroup:
                _warned_no_cgroup = True
                log.warning(
                    "desktop sandbox: cannot use a cgroup under %s (%s): the memory limit "
                    "(%s MiB) is not enforced; file size and process limits still are",
                    root,
                    exc,
                    limits.memory_mb,
                )
            continue
        made.append(group)
    return made
