"""`manage.py run_flower` (`make flower`): Flower, the Celery monitor, for a `make run` stack:
queues, workers, every task with its arguments and outcome. It listens on 127.0.0.1:5555
and the dashboard serves it at /flower/ to admins only (dartboard/flower.py), passing
Flower's own login along: user `ops`, the password generated once in
DARTBOARD_HOME/flower_password (or FLOWER_BASIC_AUTH=user:password). Flower's API runs any
task, so it is never served without both.
"""

from __future__ import annotations

import os
import sys

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from dartboard.flower import flower_login


class Command(BaseCommand):
    help = "Run Flower (the Celery monitor) on 127.0.0.1:5555; the dashboard serves it at /flower/."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=5555)

    def handle(self, *args: object, **options: object) -> None:
        port = int(str(options["port"]))
        login = flower_login()
        self.stdout.write(
            f"Flower on http://127.0.0.1:{port}/flower/, served to admins at the dashboard's "
            f"/flower/ (its own login: user {login.split(':', 1)[0]}, password in "
            f"{settings.DARTBOARD_HOME / 'flower_password'} or FLOWER_BASIC_AUTH)"
        )
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "dartboard",
            "flower",
            "--address=127.0.0.1",
            f"--port={port}",
            "--url_prefix=flower",
        ]
        # The login goes by environment, not argv (which every local user can read).
        os.execve(sys.executable, argv, {**os.environ, "FLOWER_BASIC_AUTH": login})
