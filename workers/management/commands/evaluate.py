"""`python manage.py evaluate --policy P --tasks T --k K [--sampled] [--out PATH]`

P: 'oracle', a local HF checkpoint directory, 'shipped', 'untrained' or run:ID:vN.
T: 'split:eval', 'tag:click' or task names separated by commas.
Writes PATH.json and PATH.csv (default: DARTBOARD_HOME/reports/eval-<job>). The exit code is
non-zero only if the evaluation could not run, never because the policy scored low.
"""

import csv
import json
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from datamanager.policies import EvalSetupError
from datamanager.selectors.tasks import tasks_select
from datamanager.services.evaluations import eval_job_create
from workers.evaluation import eval_job_run

CSV_FIELDS = [
    "task", "episodes", "successes", "success_rate", "ci_low", "ci_high", "mean_reward",
    "pass_at_1", "pass_at_k", "mean_steps_of_successes", "parse_error_rate", "env_errors",
]  # fmt: skip


def write_report(report: dict, out: Path) -> tuple[Path, Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out.with_suffix(".json"), out.with_suffix(".csv")
    json_path.write_text(json.dumps(report, indent=2))
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in report["tasks"]:
            writer.writerow({k: row[k] for k in CSV_FIELDS})
    return json_path, csv_path


class Command(BaseCommand):
    help = "Evaluate a policy on a task set (k episodes per task, fixed seeds)."

    def add_arguments(self, parser):
        parser.add_argument("--policy", required=True)
        parser.add_argument("--tasks", required=True)
        parser.add_argument("--k", type=int, default=1)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--sampled", action="store_true", help="Sample instead of greedy.")
        parser.add_argument("--temperature", type=float, default=1.0)
        parser.add_argument("--name", default="")
        parser.add_argument("--out", type=Path, default=None)

    def handle(self, *args, policy, tasks, k, seed, sampled, temperature, name, out, **options):
        try:
            selected = tasks_select(spec=tasks)
            job = eval_job_create(
                name=name or f"{policy} on {tasks}",
                policy=policy,
                tasks=selected,
                k=k,
                seed=seed,
                greedy=not sampled,
                temperature=temperature,
            )
        except EvalSetupError as exc:
            raise CommandError(str(exc)) from None
        bar = tqdm(total=job.total, desc=f"eval #{job.pk}", unit="episode")
        try:
            job = eval_job_run(job_id=job.pk, on_episode=lambda: bar.update(1))
        except Exception as exc:
            raise CommandError(
                f"evaluation #{job.pk} could not run: {type(exc).__name__}: {exc}"
            ) from None
        finally:
            bar.close()
        out = out or settings.DARTBOARD_HOME / "reports" / f"eval-{job.pk}"
        json_path, csv_path = write_report(job.report, out)
        s = job.report["summary"]
        self.stdout.write(
            f"eval #{job.pk}: success {s['success_rate']:.1%} "
            f"(95% CI {s['ci_low']:.1%}-{s['ci_high']:.1%}) over {s['episodes']} episodes, "
            f"{s['env_errors']} env errors; report {json_path}, {csv_path}"
        )
