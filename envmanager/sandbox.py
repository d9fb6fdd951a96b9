"""The sandbox every program the policy drives runs in: bubblewrap under a uid of its own.

The policy's text becomes keystrokes in a shell, an editor, a browser, and clicks on a window
manager. Those programs run under `bwrap` (Debian's bubblewrap) as a uid leased for this one
sandbox (`UidLease`: AGENT_UID_BASE .. +AGENT_UID_COUNT, no passwd entry, one per desktop or
browser, so one slot's processes never count against another's limits), in their own user,
pid, ipc, uts, cgroup and network namespaces. What a sandboxed program sees:

- /usr read-only, and from /etc only what programs need to start (fonts, the loader cache,
  X11 and chromium configuration, alternatives);
- its own /proc and /dev, a size-limited tmpfs /tmp and home (/home/agent);
- the task directory at /home/agent/task: on the host a size-limited tmpfs of its own,
  read-write (the only thing that outlives a program);
- the X display's socket and an agent copy of its auth cookie, and the environment DISPLAY,
  XAUTHORITY, HOME, PATH, LANG and nothing else.

Not: the network (an empty network namespace: no route, no DNS), DARTBOARD_HOME, the
checkout and its virtual environment, the worker's environment (SECRET_KEY, DATABASE_URL,
REDIS_URL, S3 keys, tokens), other processes, other desktops' displays. What it cannot do:
create user namespaces (`--disable-userns`), or make the system calls `envmanager.seccomp`
denies (namespaces, mounts, ptrace, key ring, bpf, ...). Limits: RLIMIT_FSIZE and
RLIMIT_NPROC of its uid; memory and process count through a cgroup of its own, which is
required: without one the sandbox refuses to start unless the admin sets
DARTBOARD_ALLOW_UNLIMITED_SANDBOX=1 (then `Sandbox.unlimited` says why, for the host map).
Output read back from a sandboxed command is capped (`Sandbox.run`).

    sandbox = Sandbox(task_dir=Path("/tmp/x/task"), display=":7", xauth_cookie=cookie)
    proc = sandbox.popen(["xterm", "-e", "bash"])
    sandbox.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from core.procutil import die_with_parent
from envmanager.sandbox_limits import (
    ALLOW_UNLIMITED_ENV,
    TASK_MOUNT_SOURCE,
    SandboxLimits,
    SandboxUnavailable,
    UidLease,
    children,
    kill_and_remove,
    kill_same,
    sandbox_cgroups,
    start_time,
    unlimited_allowed,
    unmount_stale_task_dirs,
)
from envmanager.seccomp import SeccompUnsupported, filter_bytes

log = logging.getLogger("dartboard.sandbox")

HOME = "/home/agent"
TASK_DIR = f"{HOME}/task"
XAUTHORITY = "/tmp/.Xauthority"  # the agent's copy of its display's cookie, inside
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
    # The desktop applications' own configuration (make desktop-apps): LibreOffice reads its
    # registry there and aborts without it.
    "libreoffice",
    "gimp",
    "thunderbird",
    "vlc",
)


@dataclass(frozen=True)
class SandboxResult:
    """A finished sandboxed command: like subprocess.CompletedProcess, plus whether its
    output passed the cap and was cut (the command was then killed)."""

    args: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes
    truncated: bool = False


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: `make install` installs Debian's bubblewrap"
        )
    return path


class Sandbox:
    """The sandbox of one desktop: its uid, task directory, display and resource limits."""

    def __init__(
        self,
        *,
        task_dir: Path,
        display: str,
        xauth_cookie: bytes | None = None,
        limits: SandboxLimits = SandboxLimits(),
        mount_at: str = TASK_DIR,
        home: str = HOME,
        ro_binds: tuple[tuple[str, str], ...] = (),
        extra_env: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """xauth_cookie: the display's MIT-MAGIC-COOKIE-1 (Xvfb demands it); mount_at: where
        the task directory appears inside (an OSWorld-protocol desktop mounts it as the whole
        home, /home/user); home: $HOME inside; ro_binds: more read-only (host, inside)
        mounts, e.g. the sandbox's pyautogui; extra_env: more variables of the clean
        environment (never the worker's). Raises SandboxUnavailable."""
        self.task_dir = task_dir
        self.display = display
        self.limits = limits
        self.mount_at = mount_at
        self.home = home
        self.ro_binds = ro_binds
        self.extra_env = extra_env
        self.unlimited: str | None = None  # why limits are not enforced (admin allowed it)
        self._lease = UidLease()
        self.uid = self._lease.uid
        self._mounted = False
        self._cgroups: list[Path] = []
        self._xauth: str | None = None
        try:
            try:
                self._cgroups = sandbox_cgroups(uid=self.uid, limits=limits)
            except SandboxUnavailable as exc:
                if not unlimited_allowed():
                    raise
                self.unlimited = str(exc)
            self.prepare_task_dir()  # bwrap binds it: it must exist before the first program
            if xauth_cookie is not None:
                self._xauth = self._write_xauth(xauth_cookie)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ files

    def prepare_task_dir(self) -> None:
        """The task directory, empty and owned by the sandbox uid: a tmpfs of
        `task_dir_mb` on the host, mounted once and emptied at each call. Its parent stays
        root's (mode 0711), so the agent can change what is inside but not swap it."""
        self.task_dir.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.task_dir.parent, 0o711)
        if not self._mounted:
            unmount_stale_task_dirs()
            self.task_dir.mkdir(exist_ok=True)
            self._mounted = self._mount_task_dir()
        for child in list(self.task_dir.iterdir()):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        os.chown(self.task_dir, self.uid, self.uid)
        os.chmod(self.task_dir, 0o700)

    def _mount_task_dir(self) -> bool:
        source = f"{TASK_MOUNT_SOURCE}-{os.getpid()}-{start_time(os.getpid())}"
        options = f"size={self.limits.task_dir_mb}m,mode=0700,nosuid,nodev"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, source, str(self.task_dir)],
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            return True
        why = f"cannot mount the task directory's tmpfs ({done.stderr.strip()})"
        if not unlimited_allowed():
            raise SandboxUnavailable(
                f"desktop sandbox: {why}; the worker must run as root, or the admin sets "
                f"{ALLOW_UNLIMITED_ENV}=1 to run without a task directory quota"
            )
        self.unlimited = "; ".join(filter(None, [self.unlimited, why]))
        return False

    def write_file(self, name: str, content: str) -> None:
        """A fixture file of the task's setup, owned by the agent."""
        path = self.task_dir / name
        path.write_text(content)
        os.chown(path, self.uid, self.uid)

    def _write_xauth(self, cookie: bytes) -> str:
        """The agent's copy of the display cookie beside the task directory (its uid, 0400)."""
        path = self.task_dir.parent / f"xauth-{self.uid}"
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o711)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(xauth_record(cookie))
        os.chown(path, self.uid, self.uid)
        return str(path)

    # ------------------------------------------------------------------ programs

    def environ(self) -> dict[str, str]:
        env = {"DISPLAY": self.display, "HOME": self.home, "PATH": AGENT_PATH, "LANG": "C.UTF-8"}
        if self._xauth is not None:
            env["XAUTHORITY"] = XAUTHORITY
        return {**env, **dict(self.extra_env)}

    def argv(
        self, program: list[str], *, extra_ro_binds: tuple[tuple[str, str], ...] = ()
    ) -> list[str]:
        """The bwrap command line that runs `program` (paths as the sandbox sees them),
        without the seccomp descriptor (`popen` and `run` add it)."""
        number = self.display.lstrip(":").split(".")[0]
        x_socket = f"/tmp/.X11-unix/X{number}"
        binds = [(x_socket, x_socket), *self.ro_binds, *extra_ro_binds]
        if self._xauth is not None:
            binds.append((self._xauth, XAUTHORITY))
        return bwrap_argv(
            program,
            env=self.environ(),
            binds=[(str(self.task_dir), self.mount_at)],
            ro_binds=binds,
            chdir=self.mount_at,
            limits=self.limits,
        )

    def popen(
        self, program: list[str], *, extra_ro_binds: tuple[tuple[str, str], ...] = ()
    ) -> subprocess.Popen:
        """Start `program` in the sandbox (stopped by `kill_sandboxed`, or with the sandbox's
        cgroups at `close`)."""
        with seccomp_fd() as fd:
            return subprocess.Popen(
                with_seccomp(self.argv(program, extra_ro_binds=extra_ro_binds), fd),
                env={},
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(fd,),
                preexec_fn=self._drop_privileges(),
            )

    def run(
        self,
        program: list[str],
        *,
        timeout_s: float,
        stdin: bytes | None = None,
        max_output_bytes: int = 4 * 1024 * 1024,
    ) -> SandboxResult:
        """Run `program` in the sandbox to completion, `stdin` fed to it. Each of stdout and
        stderr keeps at most `max_output_bytes`: past that the command and everything it
        started are killed (`kill_sandboxed`) and the result says `truncated`. Raises
        subprocess.TimeoutExpired after `timeout_s` (killed the same way first)."""
        with seccomp_fd() as fd:
            proc = subprocess.Popen(
                with_seccomp(self.argv(program), fd),
                env={},
                cwd="/",
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(fd,),
                preexec_fn=self._drop_privileges(),
            )
        return _communicate_capped(proc, stdin=stdin, timeout_s=timeout_s, cap=max_output_bytes)

    def close(self) -> None:
        """Unmount the task directory, remove the cgroups (their processes have been stopped)
        and give the uid back; safe to call twice."""
        if self._mounted:
            subprocess.run(["umount", "--lazy", str(self.task_dir)], capture_output=True)
            self._mounted = False
        for group in self._cgroups:
            kill_and_remove(group)
        self._cgroups = []
        if self._xauth is not None:
            Path(self._xauth).unlink(missing_ok=True)
        self._lease.release()

    def _drop_privileges(self) -> Callable[[], None]:
        limits, cgroups, uid = self.limits, list(self._cgroups), self.uid
        return lambda: drop_privileges(limits, cgroups, uid=uid)  # in the child, before exec


def bwrap_argv(
    program: list[str],
    *,
    env: dict[str, str],
    binds: list[tuple[str, str]],
    ro_binds: list[tuple[str, str]],
    chdir: str,
    limits: SandboxLimits,
) -> list[str]:
    """bwrap with every namespace unshared (no network) and no further user namespaces, a
    clean environment `env`, /usr and a few /etc entries read-only, its own /proc, /dev and
    sized tmpfs /tmp and home, plus `binds` (read-write) and `ro_binds`, each (host path,
    sandbox path)."""
    # Laid out by hand: each flag beside its values, as on the command line.
    args = [
        bwrap_path(),
        "--unshare-all",  # user, pid, ipc, uts, cgroup and network namespaces
        "--unshare-user",
        "--disable-userns",  # no user namespace can be made inside
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
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(limits.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]
    args += ["--size", str(limits.home_mb * 1024 * 1024), "--tmpfs", HOME]
    for host, inside in binds:
        args += ["--bind", host, inside]
    for host, inside in ro_binds:
        args += ["--ro-bind", host, inside]
    return [*args, "--chdir", chdir, "--", *program]


def with_seccomp(argv: list[str], fd: int) -> list[str]:
    """`argv` (a bwrap command line) with the seccomp filter read from descriptor `fd`."""
    return [argv[0], "--seccomp", str(fd), *argv[1:]]


@contextlib.contextmanager
def seccomp_fd():  # type: ignore[no-untyped-def]
    """A descriptor holding the seccomp filter (an in-memory file), closed on exit; pass it
    to the child (pass_fds) and name it with `with_seccomp`."""
    try:
        program = filter_bytes()
    except SeccompUnsupported as exc:
        raise SandboxUnavailable(str(exc)) from exc
    fd = os.memfd_create("dartboard-seccomp", 0)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def drop_privileges(limits: SandboxLimits, cgroups: list[Path], *, uid: int) -> None:
    """Join the cgroups, set the limits and become `uid` (in a child before exec)."""
    for group in cgroups:
        (group / "cgroup.procs").write_text(str(os.getpid()))
    file_size = limits.file_size_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    die_with_parent()  # after setuid: a credential change clears the death signal


def xauth_record(cookie: bytes) -> bytes:
    """An Xauthority file holding `cookie` (MIT-MAGIC-COOKIE-1) for every display number:
    one FamilyWild entry (libXau matches it for any address) and one FamilyLocal entry for
    this host's name (python-xlib, pyautogui's, matches by family and address only)."""
    out = b""
    for family, address in ((0xFFFF, b""), (0x0100, socket.gethostname().encode())):
        out += family.to_bytes(2, "big")
        for field in (address, b"", b"MIT-MAGIC-COOKIE-1", cookie):
            out += len(field).to_bytes(2, "big") + field
    return out


def kill_sandboxed(proc: subprocess.Popen) -> None:
    """SIGKILL a program started under bwrap and everything it started. Killing bwrap's
    process group does not reach the program: `--new-session` gives it a session of its
    own, and bwrap's `--die-with-parent` does not always take the sandbox down with a killed
    bwrap (under a loaded worker, `yes` past its output cap wrote on until its timeout).
    bwrap's child is the init of the sandbox's PID namespace: when it dies, the kernel kills
    every process in the namespace."""
    inits = children(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    kill_same(inits)


def _communicate_capped(
    proc: subprocess.Popen, *, stdin: bytes | None, timeout_s: float, cap: int
) -> SandboxResult:
    """Feed stdin, read stdout and stderr up to `cap` bytes each (a reader past the cap kills
    the sandboxed program: `yes` must not fill the worker's memory), wait up to `timeout_s`."""
    chunks: dict[str, list[bytes]] = {"out": [], "err": []}
    truncated = threading.Event()

    def read(name: str, stream) -> None:  # type: ignore[no-untyped-def]
        total = 0
        while True:
            data = stream.read1(65536)
            if not data:
                return
            keep = data[: max(0, cap - total)]
            chunks[name].append(keep)
            total += len(data)
            if total > cap:
                truncated.set()
                kill_sandboxed(proc)
                while stream.read1(65536):  # drain what is left, keep nothing
                    pass
                return

    def write() -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            proc.stdin.write(stdin)  # type: ignore[union-attr]
        with contextlib.suppress(BrokenPipeError, OSError):
            proc.stdin.close()  # type: ignore[union-attr]

    threads = [
        threading.Thread(target=read, args=("out", proc.stdout), daemon=True),
        threading.Thread(target=read, args=("err", proc.stderr), daemon=True),
    ]
    if stdin is not None:
        threads.append(threading.Thread(target=write, daemon=True))
    for thread in threads:
        thread.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_sandboxed(proc)
        proc.wait()
        for thread in threads:
            thread.join(timeout=5)
        raise
    for thread in threads:
        thread.join(timeout=timeout_s)
    return SandboxResult(
        args=list(proc.args),  # type: ignore[arg-type]
        returncode=proc.returncode,
        stdout=b"".join(chunks["out"]),
        stderr=b"".join(chunks["err"]),
        truncated=truncated.is_set(),
    )
