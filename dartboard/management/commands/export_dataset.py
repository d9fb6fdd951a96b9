"""`python manage.py export_dataset OUT [--formats hf,sft,osworld] [--filter QUERY]`: write
trajectories as a Hugging Face dataset (parquet with embedded screenshots, `successes` and
`failures` configs, a card), an SFT view and/or OSWorld result folders into the folder OUT
(datamanager/services/datasets.py).

QUERY is the trajectory list's query string, as the browser shows it after `?` (the same
filters, checked the same way), e.g. `run=3&status=succeeded&reviewed=yes`.

    .venv/bin/python manage.py export_dataset ~/exports/run3 --filter "run=3" --formats hf,sft
    python -c "import datasets; print(datasets.load_dataset('$HOME/exports/run3', 'successes'))"
"""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.http import QueryDict
from tqdm import tqdm

from dartboard.forms import TrajectoryFilterForm
from datamanager.services.datasets import EXPORT_FORMATS, ExportError, dataset_write


class Command(BaseCommand):
    help = "Export trajectories as a Hugging Face dataset, an SFT view or OSWorld result folders."

    def add_arguments(self, parser):
        parser.add_argument("out", type=Path, help="A new or empty folder.")
        parser.add_argument("--formats", default="hf", help=f"Some of {','.join(EXPORT_FORMATS)}.")
        parser.add_argument(
            "--filter", default="", dest="query", help="The trajectory list's query."
        )
        parser.add_argument("--licence", default="other", help="The dataset card's licence field.")

    def handle(self, *args, out: Path, formats: str, query: str, licence: str, **options):
        if out.exists() and any(out.iterdir()):
            raise CommandError(f"{out}: not empty; give a new or empty folder")
        form = TrajectoryFilterForm(QueryDict(query.lstrip("?")))
        if not form.is_valid():
            raise CommandError(f"--filter: {form.errors.as_text()}")
        bar = tqdm(total=0, unit="trajectory", desc="exporting", disable=None)

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            counts = dataset_write(
                flt=form.trajectory_filter(),
                formats=formats.split(","),
                out=out,
                query=query,
                licence=licence,
                progress=progress,
            )
        except ExportError as exc:
            raise CommandError(str(exc)) from None
        finally:
            bar.close()
        rows = ", ".join(f"{name} {n}" for name, n in counts.rows.items())
        self.stdout.write(f"{out}: {counts.trajectories} trajectories ({rows or 'folders only'})")
