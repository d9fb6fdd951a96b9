"""`manage.py publish_policy DIR`: store a base model in the artifact store and print its
reference, to give a run as its policy on a deployment of more than one host."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from datamanager.policies import PolicyNotFound, policy_publish


class Command(BaseCommand):
    help = "Upload a checkpoint directory to DARTBOARD_ARTIFACTS; prints artifact:KEY@SHA256."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("directory", type=Path)

    def handle(self, *args: object, **options: object) -> None:
        directory = Path(str(options["directory"])).expanduser().resolve()
        try:
            self.stdout.write(policy_publish(directory))
        except PolicyNotFound as exc:
            raise CommandError(str(exc)) from None
