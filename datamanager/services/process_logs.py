"""Writes of the runs' process logs: the end of each log, copied from its host by the host
agent (`hostagent.log_ship`), secrets redacted before anything is stored."""

from __future__ import annotations

from collections.abc import Iterable

from django.conf import settings

from core.redact import redact
from datamanager.models import Run, RunProcessLog

TAIL_BYTES = 64 * 1024  # a log's end kept: about 600 lines of a worker's log, one row each

# The secrets the settings hold, which the web, the agent and a launcher's children may print.
OWN_SECRETS = (
    "SECRET_KEY",
    "DARTBOARD_SERVICE_TOKEN",
    "DARTBOARD_INFERENCE_TOKEN",
    "DARTBOARD_ADMIN_TOKEN",
)


def process_log_record(
    *,
    run_id: int,
    host: str,
    process: str,
    tail: str,
    size: int,
    running: bool,
    secrets: Iterable[str] = (),
) -> RunProcessLog | None:
    """Store the end of `process`'s log on `host` (one row per run, host and process, its
    tail replaced), with every secret `core.redact.redact` finds, the `secrets` the caller
    knows (its processes' tokens) and this server's own written as ***. None when the run is
    gone (deleted while its processes still ran)."""
    if not Run.objects.filter(pk=run_id).exists():
        return None
    known = [*secrets, *(str(getattr(settings, name, "") or "") for name in OWN_SECRETS)]
    row, _ = RunProcessLog.objects.update_or_create(
        run_id=run_id,
        host=host,
        process=process,
        # PostgreSQL's text holds no NUL; a binary byte in a log is no reason to drop it all.
        defaults={
            "tail": redact(tail, known=known).replace("\x00", "\ufffd"),
            "size": size,
            "running": running,
        },
    )
    return row
