"""Database connection hygiene and outage retries for long-running worker loops.

A worker outlives database restarts: PostgreSQL stopped and started again, a network blip,
or SQLite's "database is locked" while another process holds the write lock. Each of those
raises a transient `OperationalError` / `InterfaceError`; `db_retry` calls the function
again with bounded exponential backoff (DARTBOARD_DB_RETRY_S in all), dropping the broken
connection between tries so Django opens a fresh one. Anything else (a constraint, a
missing table, a bug) is raised at once. Past the budget it raises `DatabaseUnavailable`,
which names what was being written and the last error.

Object storage (S3: screenshots, published versions) goes away the same way, and the same
retry covers it: a refused or timed-out connection, or a 5xx / SlowDown answer, is retried;
past the budget `StorageUnavailable` says what was being stored. A worker never mistakes
either outage for a broken environment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from botocore.exceptions import ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError
from django.conf import settings
from django.db import close_old_connections, connection
from django.db.utils import InterfaceError, OperationalError

from datamanager.live_work import REDIS_DOWN

log = logging.getLogger("dartboard.db")

T = TypeVar("T")

# SQLite's transient errors; its other OperationalErrors (no such table, syntax) are not.
_SQLITE_TRANSIENT = ("database is locked", "database table is locked", "disk i/o error")


class DatabaseUnavailable(RuntimeError):
    """The database stayed unreachable (or locked) for the whole retry budget."""


class StorageUnavailable(RuntimeError):
    """Object storage stayed unreachable (or kept failing) for the whole retry budget."""


_S3_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"}


def is_transient_storage_error(exc: BaseException) -> bool:
    """True for object-storage errors a retry can cure: no connection, a timeout, a dropped
    connection, a 5xx or a SlowDown. A missing bucket or a refused credential is not."""
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error.get("Code") in _S3_TRANSIENT_CODES or int(status or 0) >= 500
    return False


def refresh_connection() -> None:
    """Drop a stale or broken connection between iterations of a long loop (a worker that
    outlives CONN_MAX_AGE or a database restart). Inside an atomic block (a caller's
    transaction, or a test's) the connection is left alone."""
    if not connection.in_atomic_block:
        close_old_connections()


def is_transient_db_error(exc: BaseException) -> bool:
    """True for errors a retry can cure: a lost or refused connection, a server shutting
    down, SQLite's lock timeout."""
    if isinstance(exc, InterfaceError):
        return True
    if not isinstance(exc, OperationalError):
        return False
    if connection.vendor == "sqlite":
        return any(text in str(exc).lower() for text in _SQLITE_TRANSIENT)
    return True


def is_outage(exc: BaseException) -> bool:
    """The database, Redis or object storage went away (a restart, a lock): waiting cures it."""
    return (
        isinstance(exc, (DatabaseUnavailable, StorageUnavailable, *REDIS_DOWN))
        or is_transient_db_error(exc)
        or is_transient_storage_error(exc)
    )


def _drop_connection() -> None:
    try:
        connection.close()
    except Exception:  # closing a dead connection may fail too; a new one is opened anyway
        log.debug("closing a broken database connection failed", exc_info=True)


def db_retry(
    fn: Callable[[int], T],
    *,
    what: str,
    budget_s: float | None = None,
    first_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
) -> T:
    """Call `fn(attempt)` (attempt 0, 1, ...) until it returns, retrying transient database
    and object-storage errors for up to `budget_s` seconds (settings.DARTBOARD_DB_RETRY_S by
    default). `fn` must be safe to call again after a failure (each attempt is its own
    transaction, or checks what an earlier attempt wrote: it gets the attempt number for that).

    Inside an atomic block a database error cannot be retried (the transaction is lost with
    the connection), so it is raised as it is."""
    budget = settings.DARTBOARD_DB_RETRY_S if budget_s is None else budget_s
    deadline = time.monotonic() + budget
    delay = first_delay_s
    attempt = 0
    while True:
        try:
            return fn(attempt)
        except Exception as exc:
            storage = is_transient_storage_error(exc)
            database = isinstance(exc, (OperationalError, InterfaceError)) and (
                not connection.in_atomic_block and is_transient_db_error(exc)
            )
            if not (storage or database):
                raise
            service = "object storage" if storage else "the database"
            if time.monotonic() + delay > deadline:
                unavailable = StorageUnavailable if storage else DatabaseUnavailable
                raise unavailable(
                    f"{service} was unreachable for {budget:.0f} s while {what} "
                    f"({attempt + 1} tries); last error: {type(exc).__name__}: "
                    f"{str(exc).strip()}"
                ) from exc
            if attempt == 0:
                log.warning(
                    "%s error while %s, retrying for up to %.0f s: %s",
                    service,
                    what,
                    budget,
                    str(exc).strip(),
                )
            if database:
                _drop_connection()
            time.sleep(delay)
            delay = min(max_delay_s, delay * 2)
            attempt += 1
