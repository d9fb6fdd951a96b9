"""Database connection hygiene for long-running worker loops."""

from django.db import close_old_connections, connection


def refresh_connection() -> None:
    """Drop a stale or broken connection between iterations of a long loop (a worker that
    outlives CONN_MAX_AGE or a database restart). Inside an atomic block (a caller's
    transaction, or a test's) the connection is left alone."""
    if not connection.in_atomic_block:
        close_old_connections()
