"""The Celery app. Workers: `celery -A dartboard worker -Q env|rollout|train`.

Queues: `env` (env slots running episodes), `rollout` (router housekeeping, weight sync),
`train` (one trainer task per run), `default` (everything else).
"""

import os

from celery import Celery
from celery.signals import worker_shutting_down

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")

app = Celery("dartboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["datamanager", "envmanager", "rollout", "dartboard"])


@worker_shutting_down.connect
def _tell_loops_to_stop(**kwargs) -> None:
    from datamanager.lifecycle import shutdown_requested

    shutdown_requested.set()
