"""`python manage.py import_builtin_tasks`: every MiniWoB++ task, the desktop tasks and
the simulated ones (envmanager/sim_env.py).

The MiniWoB++ split is documented in envmanager/miniwob_tasks.py (a stable hash of the name,
with the easy click tasks pinned to train); desktop tasks carry their own split.
"""

from django.core.management.base import BaseCommand

from datamanager.services.runs import tasks_import
from datamanager.task_import import parse_task_record
from envmanager.desktop_tasks import desktop_task_records
from envmanager.miniwob_tasks import miniwob_task_records
from envmanager.sim_env import sim_task_records


class Command(BaseCommand):
    help = "Import the built-in MiniWoB++, desktop and sim tasks (idempotent)."

    def handle(self, *args, **options):
        records = [
            parse_task_record(r, f"built-in task {r.get('name')}")
            for r in miniwob_task_records() + desktop_task_records() + sim_task_records()
        ]
        created, updated = tasks_import(records=records)
        self.stdout.write(f"built-in tasks: {created} created, {updated} updated")
