"""`manage.py run_flower` (`make flower`): Flower, the Celery monitor, for a `make run` stack:
queues, workers, every task with its arguments and outcome. It listens on 127.0.0.1:5555
under /flower/ and asks for a login: user `ops`, the password generated once in
DARTBOARD_HOME/flower_password (or FLOWER_BASIC_AUTH=user:password). Flower can revoke tasks
and shut workers down, so it is never served without it.
"""

from __future__ import annotations

import os
import secrets
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser


def flower_login() -> str:
    """user:password from FLOWER_BASIC_AUTH, else ops and the password kept in the home."""
    given = os.environ.get("FLOWER_BASIC_AUTH", "").strip()
    if given:
        return given
    path = settings.DARTBOARD_HOME / "flower_password"
    if not path.exists():  # readable by its owner only from the first byte
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(18))
    return f"ops:{path.read_text().strip()}"


class Command(BaseCommand):
    help = "Run Flower (the Celery monitor) on 127.0.0.1:5555/flower/, behind a login."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=5555)

    def handle(self, *args: object, **options: object) -> None:
        port = int(str(options["port"]))
        login = flower_login()
        self.stdout.write(
            f"Flower on http://127.0.0.1:{port}/flower/ (user {login.split(':', 1)[0]}, "
            f"password in {settings.DARTBOARD_HOME / 'flower_password'} or FLOWER_BASIC_AUTH)"
        )
        argv = [sys.executable, "-m", "celery", "-A", "dartboard", "flower",
                "--address=127.0.0.1", f"--port={port}", "--url_prefix=flower"]  # fmt: skip
        # The login goes by environment, not argv (which every local user can read).
        os.execve(sys.executable, argv, {**os.environ, "FLOWER_BASIC_AUTH": login})
