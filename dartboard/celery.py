"""The Celery app. Workers: `celery -A dartboard worker -Q env|train|default`.

Queues: `env` (env slots running episodes), `train` (one trainer task per run), `default`
(the watchdog, everything else). The tasks live in `workers/tasks.py`.
"""

import os

from celery import Celery
from celery.signals import beat_init, celeryd_init, worker_shutting_down

from workers.lifecycle import shutdown_requested

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
# Django's system checks import the web's URLconf and every view (about a second of CPU per
# worker start); `manage.py migrate`, which every start runs first, and the web run them.
# CELERY_SKIP_CHECKS= (empty) runs them in the workers too.
os.environ.setdefault("CELERY_SKIP_CHECKS", "1")

app = Celery("dartboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])


@worker_shutting_down.connect
def _tell_loops_to_stop(**kwargs) -> None:
    shutdown_requested.set()


@celeryd_init.connect
@beat_init.connect
def _private_files(**kwargs) -> None:
    """What a worker writes (checkpoints, artifacts, media, logs) is this user's alone."""
    os.umask(0o077)
