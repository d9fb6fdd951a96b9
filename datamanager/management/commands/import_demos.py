"""`python manage.py import_demos PATH --format osworld|agentnet|dartboard`: import
demonstrations (datamanager/services/demos.py) from a folder or a .zip.

- osworld: OSWorld result folders, at any depth below PATH (results/<action space>/...);
- agentnet: AgentNet .jsonl files with their images anywhere below PATH;
- dartboard: Dartboard's upload archive (manifest.json and its screenshots).

Everything is read and checked before anything is written: one bad episode writes nothing,
and every problem is listed with its file and line. Imported episodes wait in the review
queue (the trajectory list's "not reviewed" filter) unless --accept.

    .venv/bin/python manage.py import_demos ~/osworld/results --format osworld --accept
"""

from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from datamanager.archive import InvalidUpload, archive_open
from datamanager.demos.episodes import DemoFiles, DirFiles, screen_size
from datamanager.services.demos import DEMO_FORMATS, demos_import, import_summary


class Command(BaseCommand):
    help = "Import demonstrations: OSWorld result folders, AgentNet lines or a Dartboard archive."

    def add_arguments(self, parser):
        parser.add_argument("path", type=Path, help="A folder, or a .zip of one.")
        parser.add_argument("--format", required=True, choices=DEMO_FORMATS, dest="fmt")
        parser.add_argument(
            "--accept",
            action="store_true",
            help="Accept them now: successful ones join their task's experience pool.",
        )
        parser.add_argument(
            "--task", default="", help="Import every episode into this task (by name)."
        )
        parser.add_argument(
            "--screen",
            default="",
            help="OSWorld: the VM's screen as WxH when its screenshots were saved at another size.",
        )
        parser.add_argument("--user", default="", help="Who accepts them (with --accept).")

    def handle(self, *args, path: Path, fmt, accept, task, screen, user, **options):
        try:
            screen_wh = screen_size(screen)
        except ValueError as exc:
            raise CommandError(f"--screen: {exc}") from None
        reviewer = None
        if user:
            reviewer = get_user_model().objects.filter(username=user).first()
            if reviewer is None:
                raise CommandError(f"--user: no user named {user!r}")
        self.stdout.write(f"reading and checking {path} ({fmt}) ...")
        bar = tqdm(total=0, unit="episode", desc="writing", disable=None)

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            report = demos_import(
                files=_files(path),
                fmt=fmt,
                accept=accept,
                user=reviewer,
                screen=screen_wh,
                task=task,
                progress=progress,
            )
        except InvalidUpload as exc:
            problems = "\n  ".join(exc.errors)
            raise CommandError(
                f"{len(exc.errors)} problem(s); nothing was imported:\n  {problems}"
            ) from None
        finally:
            bar.close()
        for line in report.duplicates + report.skipped + report.notes:
            self.stdout.write(f"  {line}")
        self.stdout.write(import_summary(report))
        if not accept and report.trajectory_ids:
            self.stdout.write(
                "They wait in the review queue: /trajectories/?source=precollected&reviewed=no"
            )


def _files(path: Path) -> DemoFiles:
    if path.is_dir():
        return DirFiles(path)
    if path.suffix.lower() == ".zip" and path.is_file():
        return archive_open(path.open("rb"))
    raise CommandError(f"{path}: not a folder or a .zip")
