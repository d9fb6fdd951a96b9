"""`python manage.py import_tasks PATH [PATH...] [--split eval]`: import tasks (see
datamanager/task_import.py).

A PATH is a Dartboard task file (JSON Lines or a JSON array), an OSWorld task file, or a
directory of *.json files (OSWorld's evaluation_examples/examples layout). Every path is
read and checked before anything is written: one bad record anywhere writes nothing and
names the file, the line or record, and the field (every bad file of a directory).
`--split` puts every task read in that split (OSWorld's files name none: train otherwise).
OSWorld tasks whose files the file cache lacks are counted after the import (they are
refused at run create until `manage.py osworld_cache` has them).

    .venv/bin/python manage.py import_tasks tasks/osworld
"""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from datamanager.models import EnvKind
from datamanager.services.runs import tasks_import
from datamanager.task_import import SPLITS, InvalidTaskRecord, read_task_path
from envmanager.osworld_file_cache import FileCache, task_urls


class Command(BaseCommand):
    help = "Import tasks from JSON Lines, JSON or OSWorld task files and directories."

    def add_arguments(self, parser):
        parser.add_argument("files", nargs="+", type=Path)
        parser.add_argument("--split", choices=SPLITS, help="the split of every task read")

    def handle(self, *args, files, split, **options):
        read = []
        for path in files:
            try:
                read.append((path, read_task_path(path, split=split)))
            except InvalidTaskRecord as exc:
                raise CommandError(f"{exc}; nothing was imported") from None
        for path, records in read:
            created, updated = tasks_import(records=records)
            self.stdout.write(f"{path}: {created} tasks created, {updated} updated")
        cache = FileCache(settings.OSWORLD_FILE_CACHE)
        records = [r for _, rs in read for r in rs if r.env_kind == EnvKind.OSWORLD]
        specs = [r.env_config["osworld"] for r in records]
        lacking = [spec for spec in specs if cache.missing(task_urls(spec))]
        if lacking:
            self.stdout.write(
                f"{len(lacking)} of these OSWorld tasks fetch files the file cache "
                f"({cache.root}) lacks: `manage.py osworld_cache status` lists them, "
                "`osworld_cache fetch` or `osworld_cache add DIR` fills it"
            )
