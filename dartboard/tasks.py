"""Small Celery tasks of the project itself."""

import socket

from celery import shared_task


@shared_task(name="dartboard.ping")
def ping() -> dict[str, str]:
    """Round trip through the broker; tells which host answered."""
    return {"pong": socket.gethostname()}
