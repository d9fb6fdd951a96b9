"""Each run's process logs, copied off this host: the end of every log a run's processes
write here (`Supervisor.log_path`) goes to the database (`RunProcessLog`, through
`datamanager.services.process_logs.process_log_record`, secrets redacted), so the run page,
the API (`GET /api/v1/runs/<id>/logs/`) and `dartboard run logs` show it without a shell on
this host, and still after the host is gone.

The host agent calls `ship` once a tick with the run groups it holds:

    shipper = LogShipper(host="gpu-1", prefix=run_prefix)
    shipper.ship(agent.groups)

A log is copied at most every SHIP_EVERY_S, only when it changed (its size or modification
time) or its process started or stopped, and only its last TAIL_BYTES, from the first whole
line in them: one database write per changed log, whatever the log's size. A group that went
(its run stopped, or failed at start) has its logs copied once more, with what its processes
said last.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from core.redact import secret_name
from datamanager.services.process_logs import TAIL_BYTES, process_log_record
from hostagent.launcher import Supervisor

log = logging.getLogger("hostagent.log_ship")

SHIP_EVERY_S = 5.0


@dataclass(frozen=True)
class LogTail:
    """The end of a log: `text` (at most the bound, whole lines) and the whole file's size."""

    text: str
    size: int


def read_tail(path: Path, *, limit: int = TAIL_BYTES) -> LogTail:
    """The last `limit` bytes of `path` as text (bad UTF-8 replaced), from the first whole
    line in them: a line the bound cuts is left out, so no half of a secret is kept without
    the name before it (unless no newline is in them at all: a progress bar redrawn with
    carriage returns is kept as it is). OSError where it cannot be read (FileNotFoundError:
    not yet made)."""
    with path.open("rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        start = max(0, size - limit)
        fh.seek(start)
        data = fh.read(limit)
    if start > 0:
        newline = data.find(b"\n")
        data = data[newline + 1 :] if newline >= 0 else data
    return LogTail(data.decode("utf-8", "replace"), size)


def group_secrets(group: Supervisor) -> list[str]:
    """The secret values the group's processes hold in their environments: this process's
    (which a child inherits) and each child's own (`ProcSpec.env`: purpose tokens, vLLM's
    key, S3 keys)."""
    envs = [os.environ, *(spec.env for spec in group.specs)]
    return sorted({v for env in envs for k, v in env.items() if secret_name(k) and v})


class LogShipper:
    """Copies the logs of a host's run groups to the database (module doc)."""

    def __init__(
        self,
        *,
        host: str,
        prefix: Callable[[int], str],
        every_s: float = SHIP_EVERY_S,
        limit: int = TAIL_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """host: the name the logs are filed under (the agent's). prefix(run_id): what the
        run's process names begin with ("run-7-"), left out of the name filed."""
        self.host = host
        self.prefix = prefix
        self.every_s = every_s
        self.limit = limit
        self.clock = clock
        self._groups: dict[int, Supervisor] = {}  # held at the last call
        self._copied: dict[tuple[int, str], tuple[int, int, bool]] = {}  # size, mtime, running
        self._last = -math.inf

    def ship(self, groups: Mapping[int, Supervisor]) -> int:
        """Copy the changed logs of `groups` (run id -> its processes) when SHIP_EVERY_S has
        passed since the last copy, and those of each group held at the last call and gone
        since, at once. How many logs were copied."""
        gone = {run_id: g for run_id, g in self._groups.items() if groups.get(run_id) is not g}
        self._groups = dict(groups)
        copied = 0
        for run_id, group in gone.items():
            copied += self._ship_group(run_id, group, stopped=True)
            self._copied = {key: v for key, v in self._copied.items() if key[0] != run_id}
        now = self.clock()
        if now - self._last >= self.every_s:
            self._last = now
            for run_id, group in groups.items():
                copied += self._ship_group(run_id, group)
        return copied

    def _ship_group(self, run_id: int, group: Supervisor, *, stopped: bool = False) -> int:
        secrets: list[str] | None = None  # read once per group, only when a log changed
        copied = 0
        for name, child in list(group.children.items()):
            path = group.log_path(name)
            running = not stopped and child.proc.poll() is None
            try:
                stat = path.stat()
                key, state = (run_id, name), (stat.st_size, stat.st_mtime_ns, running)
                if not stopped and self._copied.get(key) == state:
                    continue
                tail = read_tail(path, limit=self.limit)
            except FileNotFoundError:
                continue  # not started yet
            except OSError as exc:
                log.warning("run %s: cannot read %s to copy it: %s", run_id, path, exc)
                continue
            if secrets is None:
                secrets = group_secrets(group)
            process_log_record(
                run_id=run_id,
                host=self.host,
                process=name.removeprefix(self.prefix(run_id)),
                tail=tail.text,
                size=tail.size,
                running=running,
                secrets=secrets,
            )
            self._copied[key] = state
            copied += 1
        return copied
