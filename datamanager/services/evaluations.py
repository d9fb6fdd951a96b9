"""Writes of evaluation jobs: the job, its progress and report, its trajectories; a run's
scheduled evaluations (one job at a time on its env slots, its shards enqueued after commit)
and the run's end once the last of them is done."""

from __future__ import annotations

from collections.abc import Collection

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.curation import INSTANCE_SEED_BASE
from datamanager.live_work import eval_shard_work, work_enqueue
from datamanager.models import (
    EvalJob,
    EvalScope,
    EvalStatus,
    PolicyVersion,
    Purpose,
    Run,
    RunStatus,
    Task,
    TrainUpdate,
    Trajectory,
)
from datamanager.policies import EvalSetupError, resolve_checkpoint
from datamanager.selectors.evaluations import eval_job_done, eval_report
from datamanager.selectors.tasks import task_list
from datamanager.services.episodes import trajectories_abort_cut
from datamanager.services.runs import run_control_check, run_finish

UNDER_WAY = (EvalStatus.QUEUED, EvalStatus.RUNNING)


def eval_job_create(
    *,
    name: str,
    policy: str,
    tasks: list[Task],
    k: int,
    seed: int = 0,
    greedy: bool = True,
    temperature: float = 1.0,
    run_id: int | None = None,
    policy_version: int | None = None,
    shards: int = 0,
    scope: str = "",
    owner: User | None = None,
) -> EvalJob:
    if k < 1:
        raise EvalSetupError(f"k must be >= 1, got {k}")
    resolve_checkpoint(policy)  # fail now, with the reason, not in a worker later
    return EvalJob.objects.create(
        name=name,
        policy=policy,
        task_names=[t.name for t in tasks],
        k=k,
        seed=seed,
        greedy=greedy,
        temperature=0.0 if greedy else temperature,
        run_id=run_id,
        policy_version=policy_version,
        total=len(tasks) * k,
        shards=shards,
        scope=scope,
        owner=owner,
    )


def eval_job_start(*, job_id: int) -> EvalJob:
    """A shard begins: the job is running. A finished job stays finished (a shard delivered
    again after its last episode ended, as after a restart, has nothing to run)."""
    EvalJob.objects.filter(pk=job_id).exclude(status=EvalStatus.FINISHED).update(
        status=EvalStatus.RUNNING, error=""
    )
    return EvalJob.objects.get(pk=job_id)


def eval_job_progress(*, job_id: int) -> int:
    """Record how many of the job's episodes are done; returns that count."""
    done = eval_job_done(job_id=job_id)
    EvalJob.objects.filter(pk=job_id).update(done=done)
    return done


def eval_job_fail(*, job_id: int, error: str) -> None:
    EvalJob.objects.filter(pk=job_id).update(status=EvalStatus.FAILED, error=error)


def eval_job_finish_if_done(*, job_id: int) -> EvalJob:
    """Whoever finishes the job's last episode writes its report."""
    job = EvalJob.objects.get(pk=job_id)
    done = eval_job_done(job_id=job_id)
    if done >= job.total:
        EvalJob.objects.filter(pk=job_id).update(
            status=EvalStatus.FINISHED,
            report=eval_report(job_id=job_id),
            finished_at=timezone.now(),
            done=done,
        )
    return EvalJob.objects.get(pk=job_id)


@transaction.atomic
def eval_trajectory_start(*, job: EvalJob, task: Task, seed: int, step_cap: int) -> Trajectory:
    """An evaluation episode's trajectory (purpose eval: never trained on, never counted in
    task statistics)."""
    return Trajectory.objects.create(
        task=task,
        run=job.run,
        purpose=Purpose.EVAL,
        eval_job=job,
        instruction=task.instruction,
        seed=seed,
        step_cap=step_cap,
    )


def eval_episodes_cut_end(*, job_id: int, task_names: Collection[str], where: str) -> int:
    """End `aborted` the job's episodes of `task_names` still running. Called by the shard
    that holds their lease as it starts (`where` names it), so an episode running there was
    cut by an earlier worker's death. The watchdog ends such episodes too, but only once
    they are older than the env's silence limit: a shard resumed sooner would play the
    episode again and leave the cut one running for good. Returns how many."""
    return trajectories_abort_cut(
        Trajectory.objects.filter(eval_job_id=job_id, task__name__in=list(task_names)),
        error=f"the evaluation's worker stopped mid-episode; {where} resumed it",
    )


def scheduled_evaluations(cfg: RunConfig) -> list[tuple[str, list[Task], int, int]]:
    """(scope, tasks, seed base, k) of each evaluation a scheduled version gets: the eval
    split, the run's training instances (the seeds its groups cycle through,
    `curation.group_seed`, or the first `train_instances_k` of them) and held-out seeds of
    the same tasks."""
    plans: list[tuple[str, list[Task], int, int]] = []
    split = list(
        Task.objects.filter(split="eval", env_kind__in=cfg.tasks.env_kinds).order_by("name")
    )
    if split and cfg.evaluation.eval_split:
        plans.append((EvalScope.EVAL_SPLIT, split, 0, cfg.evaluation.k))
    trained = sorted(task_list(selection=cfg.tasks), key=lambda t: t.name)
    if trained and cfg.evaluation.train_instances:
        seed = INSTANCE_SEED_BASE + cfg.seed
        k = cfg.evaluation.train_instances_k or cfg.tasks.instances
        plans.append((EvalScope.TRAIN_INSTANCES, trained, seed, k))
    if trained and cfg.evaluation.heldout_k:
        plans.append(
            (EvalScope.HELDOUT, trained, cfg.evaluation.heldout_seed, cfg.evaluation.heldout_k)
        )
    return plans


def eval_lanes(cfg: RunConfig) -> int:
    """Env slots a scheduled evaluation runs on at once: `evaluation.slot_share` of the
    run's slots, at least one. The slots numbered below it hand over to a waiting shard."""
    return max(1, int(cfg.evaluation.slot_share * len(cfg.env.slots()) + 1e-9))


def eval_schedule_next(*, run_id: int) -> list[EvalJob]:
    """The run's next scheduled evaluation, one job at a time, so evaluation never queues up
    behind training: nothing while one is queued or running; else the starting policy
    (version 0) first, then the rest of the version under way (its scopes run one after
    another), then the newest published version due (every N-th). Versions published
    meanwhile are skipped: a gap on the run page's chart, not a queue. Called when a
    version is published and when a scheduled job ends, while the run is running. Each
    job runs on `eval_lanes` shards."""
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        cfg = run.cfg
        n = cfg.evaluation.every_n_versions
        plans = scheduled_evaluations(cfg)
        scheduled = EvalJob.objects.filter(run=run).exclude(scope="")
        if run.status != RunStatus.RUNNING or not n or not plans:
            return []
        if scheduled.filter(status__in=UNDER_WAY).exists():
            return []
        version = _version_due(run, n, {scope for scope, *_ in plans}, scheduled)
        if version is None:
            return []
        done = set(scheduled.filter(policy_version=version).values_list("scope", flat=True))
        plan = next(plan for plan in plans if plan[0] not in done)
        job = _scheduled_job(run, cfg, plan, version=version, owner=None)
    return [job]


def _scheduled_job(
    run: Run, cfg: RunConfig, plan: tuple, *, version: int, owner: User | None
) -> EvalJob:
    """Create one scheduled evaluation of `run` (a `scheduled_evaluations` plan) at `version`
    on its slots, its shards queued when the caller's transaction commits."""
    scope, tasks, seed, k = plan
    job = eval_job_create(
        name=f"{run.name} v{version} ({EvalScope(scope).label})",
        # Version 0 is the run's starting policy (no PolicyVersion row): the baseline.
        policy=f"run:{run.pk}:v{version}" if version else cfg.policy,
        tasks=tasks,
        k=k,
        seed=seed,
        greedy=cfg.evaluation.greedy,
        run_id=run.pk,
        policy_version=version,
        shards=min(len(tasks), eval_lanes(cfg)),
        scope=scope,
        owner=owner,
    )

    def enqueue() -> None:
        for shard in range(job.shards):
            work_enqueue(eval_shard_work(job_id=job.pk, shard=shard, shards=job.shards))

    transaction.on_commit(enqueue)
    return job


class EvalNotStartable(Exception):
    """An evaluation cannot start now; the message says why."""


def eval_start(*, run_id: int, scope: str, version: int | None, user: User | None) -> EvalJob:
    """Evaluate one of the run's versions (None: its newest) on one of its scheduled scopes
    now, as a scheduled evaluation runs: on the run's env slots, which hand over between
    episodes. Only while the run runs and no other scheduled evaluation of it is under way
    (one at a time on its slots); only its owner or an admin (NotYourRun). Raises
    EvalNotStartable with the reason."""
    with transaction.atomic():
        run = Run.objects.select_for_update(of=("self",)).select_related("owner").get(pk=run_id)
        run_control_check(run=run, user=user)
        if run.status != RunStatus.RUNNING:
            raise EvalNotStartable(
                f"run #{run.pk} is {run.status}: its env slots evaluate only while it runs"
            )
        cfg = run.cfg
        plans = {plan[0]: plan for plan in scheduled_evaluations(cfg)}
        if scope not in plans:
            raise EvalNotStartable(
                f"run #{run.pk} has no {EvalScope(scope).label} to evaluate on (its settings "
                "evaluation.eval_split, evaluation.train_instances and evaluation.heldout_k "
                "say which it has)"
            )
        busy = EvalJob.objects.filter(run=run, status__in=UNDER_WAY).exclude(scope="").first()
        if busy is not None:
            raise EvalNotStartable(
                f"evaluation #{busy.pk} of run #{run.pk} is under way; one at a time runs "
                "on a run's slots"
            )
        versions = PolicyVersion.objects.filter(run=run)
        if version is None:
            version = versions.order_by("-version").values_list("version", flat=True).first() or 0
        elif version and not versions.filter(version=version).exists():
            raise EvalNotStartable(f"run #{run.pk} has no policy version {version}")
        return _scheduled_job(run, cfg, plans[scope], version=version, owner=user)


def _version_due(run: Run, n: int, scopes: set[str], scheduled: QuerySet) -> int | None:
    """The version `eval_schedule_next` evaluates (None: none is due)."""

    def unfinished(version: int) -> bool:
        done = scheduled.filter(policy_version=version).values_list("scope", flat=True)
        return bool(scopes - set(done))

    if unfinished(0):
        return 0
    last = scheduled.order_by("-pk").values_list("policy_version", flat=True).first() or 0
    if unfinished(last):
        return last
    newer = PolicyVersion.objects.filter(run=run, version__gt=last).order_by("-version")
    return next((v for v in newer.values_list("version", flat=True) if v % n == 0), None)


def eval_job_next(*, job: EvalJob) -> None:
    """What follows a run's scheduled job that has ended: the run's next evaluation, or the
    run's end if that was the last it was waiting for. Called by the shard that ended the
    job, and by the watchdog for a job whose last episode it ended itself."""
    if job.run_id is not None and job.status not in UNDER_WAY:
        eval_schedule_next(run_id=job.run_id)
        run_finish_if_done(run_id=job.run_id)


def run_finish_if_done(*, run_id: int) -> bool:
    """A run whose trainer reached trainer.max_updates finishes (FINISHED; its processes
    stop) once none of its scheduled evaluations is under way or due: its last version's
    evaluation is the end of its curve. Called when the trainer reaches the limit and when a
    scheduled evaluation ends; True if the run finished now."""
    run = Run.objects.get(pk=run_id)
    cfg = run.cfg
    limit = cfg.trainer.max_updates
    updates = TrainUpdate.objects.filter(run=run).count()
    if run.status != RunStatus.RUNNING or not limit or updates < limit:
        return False
    if EvalJob.objects.filter(run=run, status__in=UNDER_WAY).exclude(scope="").exists():
        return False
    if eval_schedule_next(run_id=run_id):
        return False
    return run_finish(
        run_id=run_id,
        message=f"finished: {updates} updates (trainer.max_updates) and their evaluations",
    )
