"""Reads for the evaluation pages: the job list, a job's per-task report, the task x job
matrix and a comparison of two jobs. Plain reads (no locks, no writes), safe from any process.

Success rates follow `datamanager.eval_metrics.task_result`: only succeeded and failed
episodes are scored. Running, aborted and env-error episodes are not in the denominator
(env errors are counted apart, never as policy failures). Rates over trajectories are
counted in the database, grouped by job and task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.core.paginator import Page, Paginator
from django.db.models import Count, F, Q, QuerySet

from datamanager.eval_metrics import Episode, TaskResult, summary, task_result
from datamanager.models import (
    SCORED_STATUSES,
    EvalJob,
    EvalStatus,
    Trajectory,
    TrajectoryStatus,
)


class EvalJobMissing(Exception):
    """Evaluation job ids with no job."""

    def __init__(self, job_ids: list[int]):
        self.job_ids = job_ids
        super().__init__("no evaluation job " + ", ".join(f"#{i}" for i in job_ids))


@dataclass(frozen=True)
class EvalCell:
    """One job's episodes of one task, counted in the database."""

    job_id: int
    task: str
    successes: int
    scored: int  # succeeded + failed: the denominator
    env_errors: int

    @property
    def success_rate(self) -> float | None:
        return self.successes / self.scored if self.scored else None


def eval_cells(*, job_ids: list[int]) -> dict[tuple[int, str], EvalCell]:
    """{(job id, task name): cell} for every task the jobs have a trajectory of."""
    rows = (
        Trajectory.objects.filter(eval_job_id__in=job_ids)
        .values("eval_job_id", "task__name")
        .annotate(
            ok=Count("pk", filter=Q(status=TrajectoryStatus.SUCCEEDED)),
            scored=Count("pk", filter=Q(status__in=SCORED_STATUSES)),
            errors=Count("pk", filter=Q(status=TrajectoryStatus.ERROR)),
        )
        .order_by()
    )
    return {
        (r["eval_job_id"], r["task__name"]): EvalCell(
            job_id=r["eval_job_id"],
            task=r["task__name"],
            successes=r["ok"],
            scored=r["scored"],
            env_errors=r["errors"],
        )
        for r in rows
    }


def _cell(cells: dict[tuple[int, str], EvalCell], job: EvalJob, task: str) -> EvalCell | None:
    """The job's cell for `task`: an empty one if the job evaluates the task but has no
    episode of it yet, None if the job does not evaluate it."""
    found = cells.get((job.pk, task))
    if found is None and task in job.task_names:
        return EvalCell(job_id=job.pk, task=task, successes=0, scored=0, env_errors=0)
    return found


# --- list --------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalJobRow:
    """A job on the list page with its overall success rate.

    The rate is the finished report's pooled rate; while a job has no report (queued,
    running, failed) it is counted from the episodes finished so far (`partial`).
    """

    job: EvalJob
    success_rate: float | None
    partial: bool

    @property
    def task_count(self) -> int:
        return len(self.job.task_names)

    @property
    def progress_percent(self) -> int:
        return round(100 * self.job.done / self.job.total) if self.job.total else 0


@dataclass(frozen=True)
class EvalJobListing:
    page: Page
    rows: list[EvalJobRow]


def eval_job_queryset(*, run_id: int | None = None) -> QuerySet[EvalJob]:
    """Jobs, newest first, with scored/succeeded episode counts and the report's summary
    rate (read out of the JSON in SQL, so a page does not load 50 full reports)."""
    qs = EvalJob.objects.select_related("run").defer("report")
    if run_id is not None:
        qs = qs.filter(run_id=run_id)
    return qs.annotate(
        n_scored=Count("trajectories", filter=Q(trajectories__status__in=SCORED_STATUSES)),
        n_succeeded=Count(
            "trajectories", filter=Q(trajectories__status=TrajectoryStatus.SUCCEEDED)
        ),
        report_rate=F("report__summary__success_rate"),
        report_episodes=F("report__summary__episodes"),
    ).order_by("-created_at", "-pk")


def _row(job: Any) -> EvalJobRow:
    """`job` carries eval_job_queryset's annotations."""
    if job.status != EvalStatus.RUNNING and job.report_rate is not None:
        rate = float(job.report_rate) if job.report_episodes else None
        return EvalJobRow(job=job, success_rate=rate, partial=False)
    rate = job.n_succeeded / job.n_scored if job.n_scored else None
    return EvalJobRow(job=job, success_rate=rate, partial=True)


def eval_job_list(
    *, run_id: int | None = None, page: int | str = 1, per_page: int = 50
) -> EvalJobListing:
    """One page of jobs (newest first) as `EvalJobRow`s."""
    paged = Paginator(eval_job_queryset(run_id=run_id), per_page).get_page(page)
    return EvalJobListing(page=paged, rows=[_row(job) for job in paged.object_list])


# --- one job's report --------------------------------------------------------------------


@dataclass(frozen=True)
class EvalJobReport:
    """The per-task table of a job.

    A finished job shows its stored report. Otherwise (`partial`) the same rows are
    computed from the episodes finished so far, with the functions the report uses.
    `pending` are the job's tasks without a finished episode yet.
    """

    job: EvalJob
    tasks: list[TaskResult]
    summary: dict[str, Any]
    partial: bool
    pending: list[str]


def eval_job_task_results(job: EvalJob) -> list[TaskResult]:
    """Per-task results of the job's finished episodes (what `eval_report` stores)."""
    rows = (
        Trajectory.objects.filter(eval_job=job)
        .exclude(status=TrajectoryStatus.RUNNING)
        .annotate(parse_errors=Count("steps", filter=~Q(steps__parse_error="")))
        .values("pk", "task_id", "seed", "task__name", "status", "reward", "length", "parse_errors")
    )
    by_task: dict[str, list[Episode]] = {}
    for r in _one_per_episode([dict(r) for r in rows]):
        by_task.setdefault(r["task__name"], []).append(
            Episode(
                task=r["task__name"],
                status=r["status"],
                reward=r["reward"] or 0.0,
                steps=r["length"],
                parse_errors=r["parse_errors"],
            )
        )
    return [task_result(name, eps, job.k) for name, eps in sorted(by_task.items())]


def _one_per_episode(rows: list[dict]) -> list[dict]:
    """One ended trajectory per episode (task, seed): an episode cut by a worker's death and
    ended `aborted` may have been played again by the resumed shard; the scored one counts
    (the newest, should there be several)."""
    best: dict[tuple[int, int | None], dict] = {}
    for r in sorted(rows, key=lambda r: r["pk"]):
        key = (r["task_id"], r["seed"])
        held = best.get(key)
        if held is None or r["status"] in SCORED_STATUSES or held["status"] not in SCORED_STATUSES:
            best[key] = r
    return list(best.values())


def _episodes_ended(trajectories: QuerySet[Trajectory]) -> int:
    """Distinct episodes (task, seed) among `trajectories` that have ended."""
    return (
        trajectories.exclude(status=TrajectoryStatus.RUNNING)
        .order_by()
        .values("task_id", "seed")
        .distinct()
        .count()
    )


def eval_job_report(*, job_id: int) -> EvalJobReport:
    """Raises EvalJob.DoesNotExist for an unknown id."""
    job = EvalJob.objects.select_related("run").get(pk=job_id)
    stored = job.report.get("tasks") if job.status != EvalStatus.RUNNING else None
    if stored is not None:
        results = [TaskResult(**row) for row in stored]
        totals = job.report.get("summary") or summary(results)
    else:
        results = eval_job_task_results(job)
        totals = summary(results)
    seen = {r.task for r in results}
    return EvalJobReport(
        job=job,
        tasks=results,
        summary=totals,
        partial=stored is None,
        pending=[name for name in job.task_names if name not in seen],
    )


# --- matrix ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalMatrixRow:
    task: str
    cells: list[EvalCell | None]  # one per column; None: the job does not evaluate the task


@dataclass(frozen=True)
class EvalMatrix:
    jobs: list[EvalJob]
    rows: list[EvalMatrixRow]


def eval_matrix(*, run_id: int | None = None, limit: int = 12) -> EvalMatrix:
    """Tasks x finished jobs.

    With `run_id`: that run's finished jobs, by policy version. Without: the `limit` most
    recently created finished jobs of any run, oldest first, so runs can be compared.
    """
    finished = EvalJob.objects.filter(status=EvalStatus.FINISHED).select_related("run")
    if run_id is not None:
        jobs = list(
            finished.filter(run_id=run_id)
            .defer("report")
            .order_by(F("policy_version").asc(nulls_last=True), "created_at", "pk")
        )
    else:
        jobs = list(finished.defer("report").order_by("-created_at", "-pk")[:limit])
        jobs.reverse()
    cells = eval_cells(job_ids=[j.pk for j in jobs])
    tasks = sorted({name for j in jobs for name in j.task_names} | {t for _, t in cells})
    rows = [EvalMatrixRow(task=task, cells=[_cell(cells, j, task) for j in jobs]) for task in tasks]
    return EvalMatrix(jobs=jobs, rows=rows)


# --- comparison --------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalCompareRow:
    task: str
    a: EvalCell | None  # None: job A does not evaluate the task
    b: EvalCell | None

    @property
    def difference(self) -> float | None:
        """B's rate minus A's (None unless both have a scored episode)."""
        ra = self.a.success_rate if self.a else None
        rb = self.b.success_rate if self.b else None
        return None if ra is None or rb is None else rb - ra

    @property
    def differs(self) -> bool:
        # Cross-multiplied counts: exact, no float comparison of 1/3 against 2/6.
        if not (self.a and self.b and self.a.scored and self.b.scored):
            return False
        return self.a.successes * self.b.scored != self.b.successes * self.a.scored


def eval_compare(*, a_id: int, b_id: int) -> tuple[EvalJob, EvalJob, list[EvalCompareRow]]:
    """Two jobs per task. Tasks whose rates differ come first (largest difference first),
    then the rest by name. Raises EvalJobMissing for unknown ids."""
    found = EvalJob.objects.select_related("run").defer("report").in_bulk([a_id, b_id])
    missing = [i for i in dict.fromkeys((a_id, b_id)) if i not in found]
    if missing:
        raise EvalJobMissing(missing)
    a, b = found[a_id], found[b_id]
    cells = eval_cells(job_ids=[a.pk, b.pk])
    tasks = sorted(set(a.task_names) | set(b.task_names) | {t for _, t in cells})
    rows = [EvalCompareRow(task=t, a=_cell(cells, a, t), b=_cell(cells, b, t)) for t in tasks]
    rows.sort(key=lambda r: (not r.differs, -abs(r.difference or 0.0), r.task))
    return a, b, rows


def eval_job_done(*, job_id: int) -> int:
    """Episodes of the job that have ended (any status but running), each counted once."""
    return _episodes_ended(Trajectory.objects.filter(eval_job_id=job_id))


def eval_report(*, job_id: int) -> dict:
    job = EvalJob.objects.get(pk=job_id)
    results = eval_job_task_results(job)
    return {
        "job": job.pk,
        "name": job.name,
        "policy": job.policy,
        "policy_version": job.policy_version,
        "k": job.k,
        "seed": job.seed,
        "greedy": job.greedy,
        "temperature": job.temperature,
        "summary": summary(results),
        "tasks": [r.as_json() for r in results],
    }


def eval_shard_tasks(*, job: EvalJob, shard: int, shards: int) -> list[str]:
    """The task names one shard of a job runs (every shards-th, in name order)."""
    return sorted(job.task_names)[shard::shards]


def eval_shard_finished(*, job: EvalJob, shard: int) -> bool:
    """Whether every episode of this shard of the job has ended."""
    names = eval_shard_tasks(job=job, shard=shard, shards=job.shards)
    ended = _episodes_ended(Trajectory.objects.filter(eval_job=job, task__name__in=names))
    return ended >= len(names) * job.k


def eval_episode_ended(*, job_id: int, task_id: int, seed: int) -> bool:
    """Whether this episode of the job already ended (a resumed job skips it)."""
    return (
        Trajectory.objects.filter(eval_job_id=job_id, task_id=task_id, seed=seed)
        .exclude(status=TrajectoryStatus.RUNNING)
        .exists()
    )


def eval_jobs_listing(*, run_id: int | None = None) -> QuerySet[EvalJob]:
    """Evaluation jobs in the model's order (newest first), of one run or all."""
    qs = EvalJob.objects.all()
    return qs if run_id is None else qs.filter(run_id=run_id)


def eval_jobs_under_way(*, run_id: int) -> list[tuple[int, int]]:
    """(job id, shards) of the run's scheduled evaluation jobs queued or running."""
    return list(
        EvalJob.objects.filter(
            run_id=run_id, shards__gt=0, status__in=(EvalStatus.QUEUED, EvalStatus.RUNNING)
        ).values_list("pk", "shards")
    )
