"""`python manage.py import_tasks PATH [PATH...]`: import tasks (see datamanager/task_import.py).

A PATH is a Dartboard task file (JSON Lines or a JSON array), an OSWorld task file, or a
directory of *.json files (OSWorld's evaluation_examples/examples layout). Every path is
read and checked before anything is written: one bad record anywhere writes nothing and
names the file, the line or record, and the field.

    .venv/bin/python manage.py import_tasks tasks/osworld
"""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from datamanager.services.runs import tasks_import
from datamanager.task_import import InvalidTaskRecord, read_task_path


class Command(BaseCommand):
    help = "Import tasks from JSON Lines, JSON or OSWorld task files and directories."

    def add_arguments(self, parser):
        parser.add_argument("files", nargs="+", type=Path)

    def handle(self, *args, files, **options):
        read = []
        for path in files:
            try:
                read.append((path, read_task_path(path)))
            except InvalidTaskRecord as exc:
                raise CommandError(f"{exc}; nothing was imported") from None
        for path, records in read:
            created, updated = tasks_import(records=records)
            self.stdout.write(f"{path}: {created} tasks created, {updated} updated")
