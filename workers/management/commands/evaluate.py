"""`python manage.py evaluate --policy P --tasks T --k K [--run ID] [--sampled] [--out PATH]`

P: 'oracle', a local HF checkpoint directory, 'shipped', 'untrained' or run:ID:vN.
T: 'split:eval', 'tag:click' or task names separated by commas.
--run ID: score under that run's prompt, token budgets and env settings (run:ID:vN implies
it; without --policy, the run's newest version). A checkpoint that is not one of Dartboard's
own tiny policies needs a run: under Dartboard's prompt a UI-TARS or Qwen2.5-VL checkpoint
would be scored on a format it was never taught, so it is refused instead.
Writes PATH.json and PATH.csv (default: DARTBOARD_HOME/reports/eval-<job>). The exit code is
non-zero only if the evaluation could not run, never because the policy scored low.
"""

import csv
import json
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from datamanager.models import PolicyVersion, Run
from datamanager.policies import ORACLE_POLICY, EvalSetupError, resolve_checkpoint
from datamanager.selectors.tasks import tasks_select
from datamanager.services.evaluations import eval_job_create
from workers.evaluation import eval_job_run

CSV_FIELDS = [
    "task",
    "episodes",
    "successes",
    "success_rate",
    "ci_low",
    "ci_high",
    "mean_reward",
    "pass_at_1",
    "pass_at_k",
    "mean_steps_of_successes",
    "parse_error_rate",
    "env_errors",
]


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
        parser.add_argument(
            "--policy", default=None, help="What to score (default: --run's newest version)."
        )
        parser.add_argument(
            "--run",
            type=int,
            default=None,
            help="Score under this run's prompt, token budgets and env settings.",
        )
        parser.add_argument("--tasks", required=True)
        parser.add_argument("--k", type=int, default=1)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--sampled", action="store_true", help="Sample instead of greedy.")
        parser.add_argument("--temperature", type=float, default=1.0)
        parser.add_argument("--name", default="")
        parser.add_argument("--out", type=Path, default=None)

    def handle(
        self, *args, policy, run, tasks, k, seed, sampled, temperature, name, out, **options
    ):
        try:
            policy, run = _policy_and_run(policy, run)
            selected = tasks_select(spec=tasks)
            job = eval_job_create(
                name=name or f"{policy} on {tasks}",
                policy=policy,
                tasks=selected,
                k=k,
                seed=seed,
                greedy=not sampled,
                temperature=temperature,
                run_id=run,
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


# Dartboard's own tiny policies (the shipped, desktop and untrained ones) are Qwen3-VL; they
# were taught Dartboard's prompt, which is what a job without a run uses.
OWN_MODEL_TYPES = ("qwen3_vl",)


def _policy_and_run(policy: str | None, run: int | None) -> tuple[str, int | None]:
    """The policy to score and the run whose settings apply, or EvalSetupError saying why
    not."""
    if run is not None and not Run.objects.filter(pk=run).exists():
        raise EvalSetupError(f"--run {run}: no such run")
    if policy is None:
        if run is None:
            raise EvalSetupError("name what to score: --policy P, or --run ID (its newest version)")
        latest = PolicyVersion.objects.filter(run_id=run).order_by("-version").first()
        if latest is None:
            raise EvalSetupError(f"run {run} has published no version yet; name --policy")
        return f"run:{run}:v{latest.version}", run
    if policy.startswith("run:"):
        owner = int(policy.split(":")[1]) if policy.split(":")[1].isdigit() else None
        if run is not None and owner is not None and owner != run:
            raise EvalSetupError(f"--policy {policy} belongs to run {owner}, not --run {run}")
        return policy, owner if run is None else run
    if run is None and policy != ORACLE_POLICY:
        checkpoint, _ = resolve_checkpoint(policy)  # a directory: not the oracle, not run:
        try:
            config = (Path(str(checkpoint)) / "config.json").read_text()
            kind = json.loads(config).get("model_type", "")
        except (OSError, ValueError):
            kind = ""
        if kind not in OWN_MODEL_TYPES:
            raise EvalSetupError(
                f"{policy} is a {kind or 'unknown'} checkpoint: without a run it would be "
                "scored under Dartboard's prompt and token budgets, made for its tiny "
                "policy. Pass --run ID, a run whose config names this model's prompt "
                "(rollout.prompt ui-tars-1.5 for UI-TARS / Qwen2.5-VL) and budgets"
            )
    return policy, run
