"""`python manage.py docs_reference`: write the docs' generated reference pages
(`hostagent.docs_reference`); `--check` only says which are out of date."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from hostagent.docs_reference import ROOT, pages


class Command(BaseCommand):
    help = "Write docs/reference/ (run settings, commands, make targets) from the code."

    def add_arguments(self, parser):
        parser.add_argument(
            "--check", action="store_true", help="Write nothing; fail if a page is out of date."
        )

    def handle(self, *args, check, **options):
        stale = []
        for path, text in pages().items():
            if path.exists() and path.read_text() == text:
                continue
            stale.append(str(path.relative_to(ROOT)))
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                self.stdout.write(f"wrote {path.relative_to(ROOT)}")
        if check and stale:
            raise CommandError(
                f"out of date: {', '.join(stale)}; run `.venv/bin/python manage.py docs_reference`"
            )
