"""One OSWorld metric call in a process of its own, under memory, CPU, wall-clock and reply
limits.

A metric reads what the agent left in its desktop (a docx, a PDF, a text file, a getter
fetched it to the evaluator's cache directory), and the agent is the untrusted policy: a
docx whose document.xml inflates to gigabytes, or a PDF whose page is millions of drawing
operators, would cost the env worker memory and time without bound. So `metric_score` runs
`wheel().metrics[name](result, expected, **options)` in a child process and waits for a
JSON reply (a float, the limit it hit, or an error text cut to a bound), never a pickle:

- memory: RLIMIT_AS caps what the metric may map above what the child holds when it is
  called (the imported wheel); an allocation past it raises MemoryError in the child;
- CPU: RLIMIT_CPU, SIGXCPU at the limit (SIGKILL a second later if it survives);
- wall clock: the child is killed when no reply came in time (a metric stuck in a read
  uses no CPU);
- files: the metric runs in a private scratch directory of its own (its working directory
  and TMPDIR; removed after the call), so what some metrics write (a temp.pdf, an unpacked
  archive, a converted image) lands nowhere else, and RLIMIT_FSIZE caps any file it writes;
- the reply: at most `reply_bytes`; what the metric prints or logs goes to /dev/null, so
  the agent's file cannot fill the worker's log.

A metric past a limit raises MetricOverLimit with a reason naming the metric and the limit:
the policy made that file, so the evaluator scores it 0 (envmanager.osworld_evaluator). Any
other failure (the metric raised, the child died by another signal, a value cannot be sent
to it) raises MetricFailed, which the evaluator turns into EnvUnavailable.

The children come from multiprocessing's forkserver, which imports the wheel once
(envmanager.osworld_metric_preload): each call forks with the wheel already imported
instead of importing pandas, lxml, pdfplumber, ... again (seconds on 2 cores). The
forkserver is the calling process's own, started on its first call; this module sets its
preload list. As in any multiprocessing child, a script run as `python script.py` is
imported again in the child, so it needs the `if __name__ == "__main__":` guard (the
Celery worker and pytest start from modules and need nothing).

    score = metric_score("file_contains", "/cache/a.txt", None, options={}, has_expected=False)
"""

from __future__ import annotations

import errno
import json
import math
import multiprocessing
import os
import pickle
import re
import resource
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from envmanager.osworld_metric_review import harden
from envmanager.osworld_wheel import wheel

PRELOAD_MODULE = "envmanager.osworld_metric_preload"
MIB = 1024 * 1024


@dataclass(frozen=True)
class MetricLimits:
    """What one metric call may use (all of them per call, in its own process)."""

    # Above what the child maps when the metric is called (the imported wheel, ~450 MiB of
    # address space): python-docx, openpyxl and pdfplumber hold a parsed file at a few
    # times its inflated size, so task files of tens of MiB fit; a zip bomb's part does not.
    memory_mb: int = 512
    # pdfminer interprets a page's content stream operator by operator in Python: a long
    # real document takes seconds; a small PDF with millions of operators takes minutes.
    cpu_seconds: int = 30
    # Twice the CPU limit: on a loaded host a CPU second can take two, and a metric stuck
    # in a read (a FIFO, a slow filesystem) uses no CPU at all.
    wall_seconds: float = 60.0
    # The largest file the metric may write (an archive it unpacks, a converted image).
    file_mb: int = 256
    # The error text of a metric that raised, cut to this many characters (an exception's
    # message can quote the agent's file), and the reply's bound in bytes.
    error_chars: int = 1000
    reply_bytes: int = 8192


class MetricOverLimit(Exception):
    """The metric passed one of its limits on the agent's result; str() is the reason."""


class MetricFailed(Exception):
    """The metric raised, or its process failed; str() says how ("TypeError: ...")."""


def metric_score(
    name: str,
    result: Any,
    expected: Any,
    *,
    options: dict[str, Any],
    has_expected: bool,
    limits: MetricLimits = MetricLimits(),
) -> float:
    """`wheel().metrics[name](result[, expected], **options)` as a float, run in a child
    process under `limits`. Blocks the calling thread until the reply, at most
    `limits.wall_seconds` after the child started. Raises MetricOverLimit or MetricFailed."""
    for what, value in (("result", result), ("expected", expected), ("options", options)):
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise MetricFailed(
                f"the {what} value ({type(value).__name__}) cannot be sent to the metric's "
                f"process: {type(exc).__name__}: {exc}"
            ) from exc
    scratch = tempfile.mkdtemp(prefix="dartboard-metric-")
    try:
        return _run_child(name, result, expected, options, has_expected, limits, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_child(
    name: str,
    result: Any,
    expected: Any,
    options: dict[str, Any],
    has_expected: bool,
    limits: MetricLimits,
    scratch: str,
) -> float:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([PRELOAD_MODULE])
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_metric_child,
        args=(send, name, result, expected, has_expected, options, limits, scratch),
        name=f"osworld metric {name}",
        daemon=True,
    )
    try:
        child.start()
    except Exception as exc:
        receive.close()
        raise MetricFailed(f"its process did not start: {type(exc).__name__}: {exc}") from exc
    finally:
        send.close()
    try:
        return _read_reply(name, child, receive, limits)
    finally:
        receive.close()
        if child.exitcode is None:
            child.kill()
        child.join()
        child.close()


def _read_reply(
    name: str, child: multiprocessing.process.BaseProcess, receive: Connection, limits: MetricLimits
) -> float:
    ready = wait([receive, child.sentinel], timeout=limits.wall_seconds)
    if not ready:
        child.kill()
        raise MetricOverLimit(
            f"{name} exceeded its {limits.wall_seconds:g} s wall-clock limit reading the "
            "agent's result (killed)"
        )
    reply = None
    if receive.poll():  # a reply may wait in the pipe of a child that has exited since
        try:
            reply = json.loads(receive.recv_bytes(maxlength=limits.reply_bytes))
        except EOFError:
            pass  # it died before replying: its exit status says how
        except OSError as exc:  # recv_bytes past maxlength
            raise MetricOverLimit(
                f"{name} exceeded its {limits.reply_bytes} byte reply limit"
            ) from exc
        except ValueError as exc:
            raise MetricFailed(f"its process sent an unreadable reply: {exc}") from exc
    if reply is None:
        child.join(timeout=limits.wall_seconds)
        if child.exitcode == -signal.SIGXCPU:
            raise MetricOverLimit(
                f"{name} exceeded its {limits.cpu_seconds} s CPU time limit reading the "
                "agent's result"
            )
        raise MetricFailed(f"its process ended ({_exit_text(child.exitcode)}) without a score")
    match reply:
        case {"score": int() | float() as score}:
            return float(score)
        case {"limit": "memory"}:
            raise MetricOverLimit(
                f"{name} exceeded its {limits.memory_mb} MiB memory limit reading the "
                "agent's result"
            )
        case {"limit": "file"}:
            raise MetricOverLimit(
                f"{name} exceeded its {limits.file_mb} MiB file-size limit writing a file "
                "from the agent's result"
            )
        case {"error": str() as error}:
            raise MetricFailed(error)
    raise MetricFailed(f"its process sent an unreadable reply: {str(reply)[:200]}")


def _exit_text(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exit status {exitcode}"
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _metric_child(
    send: Connection,
    name: str,
    result: Any,
    expected: Any,
    has_expected: bool,
    options: dict[str, Any],
    limits: MetricLimits,
    scratch: str,
) -> None:
    """The child's side (a forkserver child): call the metric under the limits in the
    scratch directory, reply JSON."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        os.chdir(scratch)
        os.environ["TMPDIR"] = tempfile.tempdir = scratch
        reply = _call_limited(
            name, (result, expected) if has_expected else (result,), options, limits
        )
    except Exception as exc:  # before the call: the wheel did not import, a limit was refused
        reply = {"error": f"{type(exc).__name__}: {exc}"[: limits.error_chars]}
    send.send_bytes(json.dumps(reply).encode())
    send.close()


def _call_limited(
    name: str, args: tuple[Any, ...], options: dict[str, Any], limits: MetricLimits
) -> dict[str, Any]:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU would dump the whole child
    metric = wheel().metrics[name]  # imported already where the forkserver preloaded it
    harden()  # done in the forkserver too, where it preloaded the wheel
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(usage.ru_utime + usage.ru_stime) + limits.cpu_seconds
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _mapped_bytes() + limits.memory_mb * MIB
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    size = limits.file_mb * MIB  # Python ignores SIGXFSZ: a write past it raises EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    try:
        return {"score": float(metric(*args, **options))}
    except Exception as exc:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))  # room to build the reply
        if _caused_by(exc, lambda e: isinstance(e, MemoryError)):
            return {"limit": "memory"}
        if _caused_by(exc, lambda e: isinstance(e, OSError) and e.errno == errno.EFBIG):
            return {"limit": "file"}
        return {"error": f"{type(exc).__name__}: {exc}"[: limits.error_chars]}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def _mapped_bytes() -> int:
    """This process's address space now (VmSize), what RLIMIT_AS counts."""
    with open("/proc/self/status") as status:
        match = re.search(r"^VmSize:\s+(\d+) kB", status.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def _caused_by(exc: BaseException | None, test: Callable[[BaseException], bool]) -> bool:
    """Whether `exc` or an exception it was raised from or during passes `test`."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if test(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
