"""Reads of the runs' process logs (`RunProcessLog`): which processes a run has on which
host, and one log's tail, for the run page, the API and the command line."""

from __future__ import annotations

from django.db.models import QuerySet

from datamanager.models import RunProcessLog


class ProcessLogNotFound(LookupError):
    """No log of that process (on that host) for the run; the message names those it has."""


class ProcessOnSeveralHosts(LookupError):
    """A process name the run has on more than one host, asked for without a host."""


def process_logs_list(*, run_id: int) -> QuerySet[RunProcessLog]:
    """The run's process logs by host and process, without their tails."""
    return RunProcessLog.objects.filter(run_id=run_id).defer("tail")


def process_log_find(*, run_id: int, process: str, host: str | None = None) -> RunProcessLog:
    """The log of `process` (on `host`, which may be left out while the run has that process
    on one host only). ProcessLogNotFound or ProcessOnSeveralHosts, each with the names to
    ask for instead."""
    # No stored name holds a NUL (and PostgreSQL's text cannot): a URL's %00 finds nothing.
    named = "\x00" not in process
    matches = list(RunProcessLog.objects.filter(run_id=run_id, process=process)) if named else []
    if host is not None:
        matches = [m for m in matches if m.host == host]
    if len(matches) == 1:
        return matches[0]
    if matches:
        hosts = ", ".join(m.host for m in matches)
        raise ProcessOnSeveralHosts(
            f"run {run_id} has {process} on {len(matches)} hosts ({hosts}): name one with host"
        )
    have = [f"{r.process} on {r.host}" for r in process_logs_list(run_id=run_id)]
    where = f" on {host}" if host is not None else ""
    raise ProcessLogNotFound(
        f"run {run_id} has no log of {process}{where}"
        + (f"; its logs: {', '.join(have)}" if have else "; no process of it has logged yet")
    )
