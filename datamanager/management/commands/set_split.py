"""`python manage.py set_split FILE --split train [--others eval]`: put the tasks a split file
lists in a split, in one command (and with --others every other task in the other split).

A split file lists task names or OSWorld task ids (`<id>` means the task `osworld/<id>`):
OSWorld's and DART's lists ({"<domain>": ["<id>", ...]}, as in `test_all.json`), a JSON
array, or one per line (blank lines and lines starting with '#' skipped). A name that
matches no task is an error and nothing changes.

    .venv/bin/python manage.py set_split dart_train.json --split train --others eval
"""

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from datamanager.services.runs import tasks_set_split
from datamanager.task_import import SPLITS


def read_split_file(path: Path) -> list[str]:
    """The task names or ids a split file lists (see the module docstring)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"{path}: {exc}") from None
    if text.lstrip().startswith(("{", "[")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CommandError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg})") from None
        items = [i for ids in data.values() for i in ids] if isinstance(data, dict) else data
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise CommandError(f"{path}: expected {{domain: [ids]}} or a list of task names")
        return items
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


class Command(BaseCommand):
    help = "Put the tasks a split file lists (names or OSWorld ids) in a split."

    def add_arguments(self, parser):
        parser.add_argument("file", type=Path)
        parser.add_argument("--split", choices=SPLITS, required=True)
        parser.add_argument("--others", choices=SPLITS, help="the split of every other task")

    def handle(self, *args, file, split, others, **options):
        names = read_split_file(file)
        if not names:
            raise CommandError(f"{file}: lists no task")
        unknown = tasks_set_split(names=names, split=split, others=others)
        if unknown:
            shown = ", ".join(unknown[:10]) + (
                f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            )
            raise CommandError(
                f"{len(unknown)} listed task(s) match no task: {shown}; nothing changed"
            )
        rest = f"; every other task in {others}" if others else ""
        self.stdout.write(f"{len(set(names))} tasks in {split}{rest}")
