"""`python manage.py start_run CONFIG [--name NAME] [--wait SECONDS]`: create a run from a
JSON or YAML file of run settings (docs/reference/settings.md; what is left out takes its
default) and start it, as the dashboard's Start button does.

Where a host agent is alive (`make run` runs one), the run waits, queued, until the agent
has started its own processes; `--wait` blocks until it runs (or says why it waits). The
exit code is non-zero when the file is not a valid config, the run cannot start, or
`--wait` ran out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml
from django.core.management.base import BaseCommand, CommandError

from datamanager.config import ConfigInvalid, RunConfig
from datamanager.models import Run, RunStatus
from datamanager.services.run_workers import RunNotStartable, run_apply
from datamanager.services.runs import InvalidTransition, run_config_validate, run_create


def config_read(path: Path) -> RunConfig:
    """A run config from a .json, .yaml or .yml file, checked as the run form and the API
    check one (`run_config_validate`); CommandError lists every problem with its setting."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CommandError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise CommandError(
            f"{path}: not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}"
        ) from None
    try:
        return run_config_validate(data=data, user=None)
    except ConfigInvalid as exc:
        if len(exc.problems) == 1:
            raise CommandError(f"{path}: {exc}") from None
        lines = "\n".join(f"  {problem}" for problem in exc.problems)
        raise CommandError(f"{path}: {len(exc.problems)} problems:\n{lines}") from None


class Command(BaseCommand):
    help = "Create a run from a JSON or YAML settings file and start it."

    def add_arguments(self, parser):
        parser.add_argument("config", type=Path, help="Run settings (.json, .yaml or .yml).")
        parser.add_argument("--name", default="", help="The run's name (default: the file's).")
        parser.add_argument(
            "--wait",
            type=float,
            default=0,
            help="Seconds to wait for a queued run to be running (0: return at once).",
        )

    def handle(self, *args, config, name, wait, **options):
        cfg = config_read(config)
        run = run_create(name=name or config.stem, config=cfg)
        try:
            run = run_apply(run_id=run.pk, action="start")
        except (InvalidTransition, RunNotStartable) as exc:
            raise CommandError(f"run #{run.pk} {run.name!r} cannot start: {exc}") from None
        self.stdout.write(f"run #{run.pk} {run.name!r} is {run.status}: /runs/{run.pk}/")
        deadline = time.monotonic() + wait
        while run.status == RunStatus.QUEUED and time.monotonic() < deadline:
            time.sleep(1.0)
            run = Run.objects.get(pk=run.pk)
        if wait and run.status == RunStatus.QUEUED:
            raise CommandError(
                f"run #{run.pk} still queued after {wait:g} s: "
                f"{run.status_message or 'no host agent has taken it'}"
            )
        if wait and run.status == RunStatus.FAILED:
            raise CommandError(f"run #{run.pk} failed to start: {run.status_message}")
        if wait:
            self.stdout.write(f"run #{run.pk} is {run.status}")
