"""`python manage.py osworld_cache fetch|add|status`: the files OSWorld tasks fetch by URL,
in this host's file cache (envmanager/osworld_file_cache.py, under DARTBOARD_HOME).

    osworld_cache fetch [TASK ...]       download every file of these tasks (names, or OSWorld
                                         task files and directories; none: every imported
                                         osworld task): the one command that opens the URLs
    osworld_cache add DIR [TASK ...]     copy them from a copy of OSWorld's file-cache folder
                                         (<domain>/<task id>/<file name>)
    osworld_cache status [TASK ...]      how many of their files the cache has, and which not

Each host whose env workers run osworld slots needs the files in its own cache (copy the
folder, or run the command there); the host that checks a run at create reads its own.

    .venv/bin/python manage.py osworld_cache fetch osworld/0bf05a7d-b28b-44d2-955a-50b41e24012a
"""

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from datamanager.models import EnvKind, Task
from datamanager.task_import import InvalidTaskRecord, read_task_path
from envmanager.osworld_file_cache import CacheError, FileCache, copy_layout, task_urls


def _specs(names: list[str]) -> list[dict[str, Any]]:
    """The OSWorld task objects named: imported task names, or task files and directories."""
    if not names:
        tasks = Task.objects.filter(env_kind=EnvKind.OSWORLD).order_by("name")
        return [t.env_config["osworld"] for t in tasks]
    specs: list[dict[str, Any]] = []
    for name in names:
        path = Path(name)
        if path.exists():
            try:
                specs += [r.env_config["osworld"] for r in read_task_path(path)]
            except InvalidTaskRecord as exc:
                raise CommandError(str(exc)) from None
            continue
        task = Task.objects.filter(name=name, env_kind=EnvKind.OSWORLD).first()
        if task is None:
            raise CommandError(f"{name}: no imported osworld task and no such file")
        specs.append(task.env_config["osworld"])
    return specs


class Command(BaseCommand):
    help = "Fill or inspect the file cache that OSWorld tasks' downloads are served from."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True)
        fetch = actions.add_parser("fetch", help="download the tasks' files into the cache")
        fetch.add_argument("tasks", nargs="*")
        add = actions.add_parser("add", help="copy them from OSWorld's file-cache folder")
        add.add_argument("directory", type=Path)
        add.add_argument("tasks", nargs="*")
        status = actions.add_parser("status", help="what the cache has of the tasks' files")
        status.add_argument("tasks", nargs="*")

    def handle(self, *args, action, tasks, **options):
        cache = FileCache(settings.OSWORLD_FILE_CACHE)
        specs = _specs(tasks)
        urls = list(dict.fromkeys(url for spec in specs for url in task_urls(spec)))
        if action == "fetch":
            self._fetch(cache, urls)
        elif action == "add":
            self._add(cache, options["directory"], specs)
        else:
            missing = cache.missing(urls)
            self.stdout.write(
                f"{cache.root}: {len(urls) - len(missing)} of {len(urls)} files of "
                f"{len(specs)} tasks cached"
            )
            for url in missing:
                self.stdout.write(f"  missing: {url}")

    def _fetch(self, cache: FileCache, urls: list[str]) -> None:
        todo = cache.missing(urls)
        failed = []
        for url in tqdm(todo, desc="fetching", unit="file", disable=not todo):
            try:
                cache.fetch(url)
            except CacheError as exc:
                failed.append(str(exc))
        self.stdout.write(
            f"{cache.root}: {len(todo) - len(failed)} fetched, {len(urls) - len(todo)} "
            f"already cached, {len(failed)} failed"
        )
        if failed:
            raise CommandError("these files could not be fetched:\n" + "\n".join(failed))

    def _add(self, cache: FileCache, directory: Path, specs: list[dict[str, Any]]) -> None:
        if not directory.is_dir():
            raise CommandError(f"{directory}: not a directory")
        added: list[str] = []
        lacking: list[str] = []
        for spec in specs:
            found, missing = copy_layout(cache, directory, spec)
            added += found
            lacking += [f"{spec.get('id')}: {url}" for url in missing]
        self.stdout.write(f"{cache.root}: {len(added)} files added from {directory}")
        if lacking:
            raise CommandError(
                f"{len(lacking)} files are not in {directory} (looked for "
                "<domain>/<task id>/<file name>):\n" + "\n".join(lacking)
            )
