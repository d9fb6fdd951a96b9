"""`python manage.py import_tasks FILE [FILE...]`: import tasks (see datamanager/task_import.py).

Each file is all-or-nothing: one bad record writes nothing from that file and names the line.
"""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from datamanager.services.runs import tasks_import
from datamanager.task_import import InvalidTaskRecord, read_task_file


class Command(BaseCommand):
    help = "Import tasks from JSON Lines or JSON files (one transaction per file)."

    def add_arguments(self, parser):
        parser.add_argument("files", nargs="+", type=Path)

    def handle(self, *args, files, **options):
        for path in files:
            try:
                records = read_task_file(path)
            except InvalidTaskRecord as exc:
                raise CommandError(f"{exc}; nothing was imported from {path}") from None
            created, updated = tasks_import(records=records)
            self.stdout.write(f"{path}: {created} tasks created, {updated} updated")
