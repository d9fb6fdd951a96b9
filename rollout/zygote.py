"""Inference servers forked from a process that has already imported them.

Importing torch and transformers is most of an inference server's start: about 5 CPU seconds
of `python -m rollout.server` before it reads its model (`python -X importtime -c "import
rollout.server"`). A zygote is a process that imports `rollout.server` once and then forks a
server per request; the child sets the environment, standard streams, working directory,
umask and arguments it was given and runs `rollout.server.main` as `python -m rollout.server`
would. A process that starts inference servers (the host agent, an evaluation worker, the
tests) starts them through `start`, and restarts cost what loading the model costs.

    proc = zygote.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.poll(); proc.wait(timeout=10); proc.send_signal(signal.SIGTERM)

`popen` is subprocess.Popen for any other command, or where zygotes are off or one failed
(`start` alone returns None there).

As with subprocess: the child's environment is exactly `env`. The zygote itself starts with
only what is read while those modules load (`IMPORT_TIME`: the interpreter's, the loader's,
the thread pools', torch's and Hugging Face's variables, the locale, HOME and PATH), never a
token, key or Dartboard setting; one zygote serves each distinct such environment and
working directory. What the child sets itself after the fork (`APPLIED_IN_CHILD`: its
streams' buffering, bytecode writing, inductor's cache) and a PYTHONPATH entry that is the
working directory do not make another zygote. A child gets SIGTERM when its zygote dies,
and a zygote when the process that started it dies (it is started from a thread that lives
as long as that process). Different: the child is the zygote's, so `ZygoteChild` reports
the exit status the zygote saw, and the child's command line in /proc is the zygote's
(`python -m rollout.zygote`; its name, `ps -o comm`, is `rollout.server`).
DARTBOARD_ZYGOTE=0 turns zygotes off: every server is then its own `python -m
rollout.server`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import gc
import io
import json
import logging
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from core.procutil import die_with_parent, pid_cmdline

log = logging.getLogger(__name__)

ENABLE_ENV = "DARTBOARD_ZYGOTE"
# Variables (by prefix) read while `rollout.server` and its imports load: the zygote starts
# with these of a server's environment. The rest (Dartboard's settings, the tokens, the
# store's keys) are read as the server runs, from the environment it is given.
IMPORT_TIME = (
    *("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "KMP_", "CUDA", "NVIDIA_"),
    *("TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "XDG_"),
    *("LANG", "LC_", "HOME", "PATH", "TMPDIR", "TZ"),
)
# Of those, what the child applies itself after the fork, as the interpreter would have at its
# start (its standard streams' buffering, whether it writes bytecode) or as torch reads it
# (inductor's cache, looked up when it compiles): a zygote serves children that differ in them.
APPLIED_IN_CHILD = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "TORCHINDUCTOR_CACHE_DIR")
MAX_ZYGOTES = 4  # per process; past that, servers start as their own processes
SERVER_MODULE = "rollout.server"
_CODE = struct.Struct("!q")
_PR_SET_NAME = 15

Stream = IO[Any] | int | None


class ZygoteError(RuntimeError):
    pass


class ZygoteChild:
    """A server forked by a zygote: the parts of subprocess.Popen a supervisor uses."""

    def __init__(self, pid: int, status: socket.socket, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._status = status  # the zygote writes the exit status here, then closes it
        self._orphaned = False

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(0.2 if left is None else min(left, 0.2))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float) -> None:
        if self._orphaned:  # the zygote died first: the child got SIGTERM from the kernel
            if pid_cmdline(self.pid) is None:  # gone, or a zombie
                self.returncode = -signal.SIGTERM
            else:
                time.sleep(timeout)
            return
        ready, _, _ = select.select([self._status], [], [], timeout)
        if not ready:
            return
        data = self._status.recv(_CODE.size)
        if len(data) == _CODE.size:
            self.returncode = _CODE.unpack(data)[0]
            self._status.close()
        else:
            self._status.close()
            self._orphaned = True


def popen(
    argv: list[str],
    *,
    env: dict[str, str],
    stdout: Stream = None,
    stderr: Stream = None,
    cwd: str | Path | None = None,
    **popen_kwargs: Any,
) -> subprocess.Popen[bytes] | ZygoteChild:
    """`argv` forked from a zygote where `start` can, else subprocess.Popen with the same
    arguments and `popen_kwargs` (stdin, preexec_fn: a forked server's stdin is
    /dev/null and it gets SIGTERM when its zygote ends)."""
    return start(argv, env=env, stdout=stdout, stderr=stderr, cwd=cwd) or subprocess.Popen(
        argv, env=env, stdout=stdout, stderr=stderr, cwd=cwd, **popen_kwargs
    )


def start(
    argv: list[str],
    *,
    env: dict[str, str],
    stdout: Stream = None,
    stderr: Stream = None,
    cwd: str | Path | None = None,
) -> ZygoteChild | None:
    """`argv` (`sys.executable -m rollout.server ...`) forked from this process's zygote for
    `env`, started first if need be. stdout and stderr as subprocess takes them (None:
    this process's, a file, a descriptor, DEVNULL; stderr also STDOUT); stdin is
    /dev/null. None where `argv` is another command, a stream is a PIPE, zygotes are off
    or one cannot start (then said in the log): the caller starts `argv` itself."""
    if argv[:3] != [sys.executable, "-m", SERVER_MODULE] or os.environ.get(ENABLE_ENV) == "0":
        return None
    if subprocess.PIPE in (stdout, stderr):  # a pipe to the caller: only subprocess has one
        return None
    workdir = os.path.abspath(cwd if cwd is not None else os.getcwd())
    base = _import_environ(env, workdir)
    key = (json.dumps(base, sort_keys=True), workdir)
    try:
        zygote = _zygote(key, base, workdir)
        if zygote is None:
            return None
        with _streams(stdout, stderr) as (out, err):
            return zygote.fork(argv, env=env, umask=_umask(), stdout=out, stderr=err)
    except (OSError, ZygoteError) as exc:  # the zygote died: the next start makes another
        with _lock:
            _zygotes.pop(key, None)
        log.warning("inference server started without a zygote: %s", exc)
        return None


def _import_environ(env: dict[str, str], workdir: str) -> dict[str, str]:
    """What of `env` the zygote imports under. PYTHONPATH loses the working directory
    (`-m` puts it first on sys.path already), so that a server given it and one not share
    a zygote."""
    base = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in APPLIED_IN_CHILD}
    path = [p for p in base.pop("PYTHONPATH", "").split(os.pathsep) if p]
    path = [p for p in path if os.path.abspath(p) != workdir]
    if path:
        base["PYTHONPATH"] = os.pathsep.join(path)
    return base


class _Zygote:
    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = theirs.fileno()

        def spawn() -> subprocess.Popen[bytes]:
            # No preexec_fn: Python code between fork and exec can deadlock on a lock another
            # thread held at the fork. The zygote asks for its SIGTERM itself (`main`).
            return subprocess.Popen(
                [sys.executable, "-m", "rollout.zygote", str(fd), str(os.getpid())],
                env=env,
                cwd=cwd,
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )

        try:
            self.proc = _keeper.submit(spawn).result()
        finally:
            theirs.close()
        self.lock = threading.Lock()
        self.control.settimeout(180)
        try:
            ready = self.control.recv(16)
        except OSError as exc:
            self.close()
            raise ZygoteError(f"the zygote did not start: {exc}") from exc
        if ready != b"ready":
            self.close()
            raise ZygoteError(f"the zygote exited with {self.proc.wait()} while importing")
        self.control.settimeout(30)

    def fork(
        self, argv: list[str], *, env: dict[str, str], umask: int, stdout: int, stderr: int
    ) -> ZygoteChild:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = json.dumps({"argv": argv, "env": env, "umask": umask}).encode()
        try:
            with self.lock:
                socket.send_fds(self.control, [request], [stdout, stderr, theirs.fileno()])
        finally:
            theirs.close()
        ours.settimeout(30)
        data = ours.recv(_CODE.size)
        if len(data) != _CODE.size:
            ours.close()
            raise ZygoteError(f"the zygote (pid {self.proc.pid}) did not fork: it exited")
        ours.settimeout(None)
        return ZygoteChild(_CODE.unpack(data)[0], ours, argv)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.control.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


_lock = threading.Lock()
_zygotes: dict[tuple[str, str], _Zygote] = {}
_failed: set[tuple[str, str]] = set()
# PDEATHSIG fires when the thread that started a child ends: zygotes are started from this
# thread, which lives as long as the process, so that they die with the process and not
# with whichever thread asked first.
_keeper = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zygote")


def _zygote(key: tuple[str, str], env: dict[str, str], cwd: str) -> _Zygote | None:
    """The live zygote for `key`, started if need be (again if it died); None past
    MAX_ZYGOTES, or where one could not start (said once: not tried again)."""
    with _lock:
        zygote = _zygotes.get(key)
        if zygote is not None and zygote.alive():
            return zygote
        _zygotes.pop(key, None)
        if key in _failed:
            return None
        if len(_zygotes) >= MAX_ZYGOTES:
            log.warning(
                "%d zygotes run: inference servers for another environment start as "
                "their own processes",
                len(_zygotes),
            )
            _failed.add(key)
            return None
        try:
            zygote = _zygotes[key] = _Zygote(env, cwd)
        except (OSError, ZygoteError) as exc:
            _failed.add(key)
            log.warning("inference servers start without a zygote: %s", exc)
            return None
        return zygote


@contextlib.contextmanager
def _streams(stdout: Stream, stderr: Stream):  # type: ignore[no-untyped-def]
    """The two descriptors the child gets as 1 and 2 (opened here where need be)."""
    opened: list[int] = []

    def fd(stream: Stream, default: int) -> int:
        if stream is None:
            return default
        if stream == subprocess.DEVNULL:
            opened.append(os.open(os.devnull, os.O_WRONLY))
            return opened[-1]
        return stream if isinstance(stream, int) else stream.fileno()

    try:
        out = fd(stdout, 1)
        yield out, out if stderr == subprocess.STDOUT else fd(stderr, 2)
    finally:
        for descriptor in opened:
            os.close(descriptor)


def _umask() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise ZygoteError("no Umask in /proc/self/status")


def _prctl(option: int, value: int | bytes) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0)


# -- the zygote's side ---------------------------------------------------------------------


def main(control_fd: int, starter: int) -> dict[str, Any] | None:
    """Import the server, say ready, fork a child per request and report each one's exit.
    Returns only in a child, with its request; returns None when the starting process
    (pid `starter`) has gone: its end of the socket closed, or it died before this began."""
    die_with_parent()  # SIGTERM when the thread that started this one ends (`_keeper`)
    if os.getppid() != starter:
        return None
    control = socket.socket(fileno=control_fd)
    import numpy  # noqa: F401 - imported here, once, for every child
    import torch  # noqa: F401

    import rollout.server  # noqa: F401

    # What was imported stays the same for every child's life: frozen, the cyclic collector
    # never walks it, not in a child's collections nor at its exit (where walking it cost a
    # server seconds of CPU, and copied every page it touched). Python's advice for fork().
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the selector
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "request")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    control.sendall(b"ready")
    zygote = os.getpid()
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                os.read(wake_read, 4096)
                _reap(children)
                continue
            message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
            if not message:
                return None
            pid = os.fork()
            if pid == 0:
                selector.close()
                control.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_read, wake_write):
                    os.close(fd)
                for status in children.values():
                    status.close()
                request = json.loads(message)
                _become(request, fds, zygote)
                return request
            os.close(fds[0])
            os.close(fds[1])
            status = socket.socket(fileno=fds[2])
            status.sendall(_CODE.pack(pid))
            children[pid] = status


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status = children.pop(pid, None)
        if status is not None:
            with contextlib.suppress(OSError):
                status.sendall(_CODE.pack(os.waitstatus_to_exitcode(wait_status)))
            status.close()


def _become(request: dict[str, Any], fds: list[int], zygote: int) -> None:
    """In the child: the streams, environment, umask and arguments it was given, a fresh
    seed."""
    import random

    import numpy
    import torch

    out, err, status = fds
    os.dup2(out, 1)
    os.dup2(err, 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd in {out, err, status, devnull}:
        os.close(fd)
    die_with_parent()
    if os.getppid() != zygote:  # the zygote died before the line above
        os._exit(1)
    _prctl(_PR_SET_NAME, SERVER_MODULE.encode())
    os.environ.clear()
    os.environ.update(request["env"])
    _started_as(request["env"])
    os.umask(request["umask"])
    sys.argv = [request["argv"][0], *request["argv"][3:]]
    random.seed()
    numpy.random.seed()
    torch.seed()


def _started_as(env: dict[str, str]) -> None:
    """What the interpreter sets at its start from APPLIED_IN_CHILD, set as `env` says: the
    standard streams unbuffered or not (stderr line-buffered, as Python makes it), and
    whether imports write bytecode."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=name == "stderr" or raw.isatty(),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))


if __name__ == "__main__":
    given = main(int(sys.argv[1]), int(sys.argv[2]))
    if given is not None:
        from rollout.server import main as serve

        serve(given["argv"][3:])
