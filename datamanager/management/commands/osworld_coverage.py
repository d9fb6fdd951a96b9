"""`python manage.py osworld_coverage DIR [--list test_all.json] [--offers ...|--run N]`:
how many OSWorld task files import and how many can run on the given slots with this
host's file cache, per domain (datamanager/osworld_coverage.py). Nothing is written.

    .venv/bin/python manage.py osworld_coverage evaluation_examples/examples \
        --list evaluation_examples/test_all.json
"""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from datamanager.models import Run
from datamanager.osworld_coverage import listed_files, osworld_coverage
from envmanager.osworld_file_cache import FileCache
from envmanager.osworld_needs import CAPABILITIES, OSWORLD_VM_OFFERS


class Command(BaseCommand):
    help = "Count the OSWorld task files of a directory that import and that can run here."

    def add_arguments(self, parser):
        parser.add_argument("directory", type=Path)
        parser.add_argument(
            "--list",
            dest="list_file",
            type=Path,
            help="a {domain: [task ids]} file (test_all.json)",
        )
        slots = parser.add_mutually_exclusive_group()
        slots.add_argument(
            "--offers",
            help="comma-separated capabilities of the slots (default: an OSWorld VM image's)",
        )
        slots.add_argument("--run", type=int, help="the slots of this run (its osworld_offers)")

    def handle(self, *args, directory, list_file, offers, run, **options):
        if not directory.is_dir():
            raise CommandError(f"{directory}: not a directory")
        if run is not None:
            found = Run.objects.filter(pk=run).first()
            if found is None:
                raise CommandError(f"no run #{run}")
            wanted = found.cfg.env.osworld_offers
        elif offers is not None:
            wanted = [o.strip() for o in offers.split(",") if o.strip()]
            unknown = sorted(set(wanted) - set(CAPABILITIES))
            if unknown:
                raise CommandError(f"unknown capabilities {unknown}; use {', '.join(CAPABILITIES)}")
        else:
            wanted = list(OSWORLD_VM_OFFERS)
        try:
            files = listed_files(directory, list_file)
        except (OSError, ValueError, AttributeError) as exc:
            raise CommandError(
                f"{list_file}: not a {{domain: [task ids]}} JSON file: {exc}"
            ) from None
        cache = FileCache(settings.OSWORLD_FILE_CACHE)
        coverage = osworld_coverage(files, offers=wanted, cache=cache)
        out = self.stdout.write
        out(f"slots offer: {', '.join(wanted)}; file cache: {cache.root}")
        out(f"{'domain':<22}{'tasks':>7}{'import':>8}{'offered':>9}{'runnable':>10}")
        rows = [*sorted(coverage.domains.items()), ("total", coverage.total())]
        for name, row in rows:
            out(f"{name:<22}{row.tasks:>7}{row.imported:>8}{row.offered:>9}{row.runnable:>10}")
        out("offered: the slots offer all the task needs; runnable: and its files are cached")
        if coverage.refusals:
            out("refused (tasks, reason):")
            for reason, n in coverage.refusals.most_common():
                out(f"  {n:>4}  {reason}")
        if coverage.lacking:
            out("imported, but needing what the slots do not offer (tasks, need):")
            for need, n in coverage.lacking.most_common():
                out(f"  {n:>4}  {need}")
        if coverage.missing_files:
            out(
                f"imported, but fetching files the file cache lacks: {coverage.missing_files} "
                "tasks (`manage.py osworld_cache fetch` or `osworld_cache add DIR`)"
            )
