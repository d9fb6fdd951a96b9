"""Evaluation jobs: a policy on a task set, k episodes per task with fixed seeds, through the
same environments, prompts, episode runner and inference server code as training.

Evaluation trajectories are stored like any other (inspectable step by step) with
purpose=eval: they never enter training batches or task statistics. Environment errors
are recorded on their trajectory and reported apart, never counted as policy failures. An
episode ends as a slot's does (workers.episode_runner): the database or the object storage
away past the retry budget ends it `error` ("database: ...", "storage: ...") and the job
goes on; a policy that does not answer fails the job.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import QuerySet

from core.imaging import QWEN25_VL, ImageGeometry
from datamanager.config import RunConfig
from datamanager.curation import INSTANCE_SEED_BASE
from datamanager.models import (
    EvalJob,
    EvalScope,
    EvalStatus,
    PolicyVersion,
    Run,
    RunStatus,
    Task,
    TrainUpdate,
)
from datamanager.policies import resolve_checkpoint
from datamanager.roles import run_env_check
from datamanager.selectors.evaluations import eval_episode_ended, eval_shard_tasks
from datamanager.selectors.tasks import task_list
from datamanager.services import evaluations
from datamanager.services.runs import run_control_check, run_finish
from envmanager.oracle_policy import OracleEndpoint
from rollout.auth import ServiceTokens
from rollout.client import InferenceError, PolicyClient
from rollout.episode import EpisodeConfig, PolicyEndpoint
from rollout.local_server import LocalPolicyServer
from workers.config_mapping import episode_config
from workers.env_cache import TaskEnv, discard_backend_envs
from workers.episode_runner import DbRecorder, episode_run
from workers.leases import (
    eval_shard_work,
    holder_name,
    redis_client,
    work_enqueue,
    work_hold,
)
from workers.lifecycle import shutdown_requested

log = logging.getLogger("dartboard.evaluate")

UNDER_WAY = (EvalStatus.QUEUED, EvalStatus.RUNNING)


@contextlib.contextmanager
def _policy_endpoint(job: EvalJob) -> Iterator[tuple[PolicyEndpoint, OracleEndpoint | None]]:
    checkpoint, version = resolve_checkpoint(job.policy)
    if checkpoint is None:
        oracle = OracleEndpoint(geometry=QWEN25_VL)
        yield oracle, oracle
        return
    log_path = settings.LOG_ROOT / f"eval-{job.pk}-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh token pair only this server and this client know.
    server = LocalPolicyServer(
        checkpoint, version=version or 0, log_path=log_path, tokens=ServiceTokens.fresh()
    )
    with server as url:
        client = PolicyClient(url, timeout=120, token=server.tokens.inference)
        try:
            yield client, None
        finally:
            client.close()


def eval_job_run(
    *, job_id: int, on_episode: Callable[[], None] | None = None, shard: int = 0, shards: int = 1
) -> EvalJob:
    """Run the job's episodes (this shard's tasks) here, one env per backend; whoever
    finishes the last episode writes the report."""
    job = evaluations.eval_job_start(job_id=job_id)
    if job.status == EvalStatus.FINISHED:
        return job
    names = eval_shard_tasks(job=job, shard=shard, shards=shards)
    by_name = {t.name: t for t in Task.objects.filter(name__in=names)}
    tasks = [by_name[n] for n in names if n in by_name]
    kinds = sorted({t.env_kind for t in tasks})
    try:
        if job.run is not None:  # a desktop or a VM only where the run was given them
            for kind in kinds:
                run_env_check(run=job.run, backend=kind)
        with _policy_endpoint(job) as (policy, oracle):
            for task in tasks:
                for i in range(job.k):
                    if shutdown_requested.is_set():
                        # The worker is stopping (Ctrl-C): leave between episodes; the
                        # shard resumes after the restart, skipping what has ended.
                        log.info("evaluation %s shard %s: left for the worker's shutdown",
                                 job.pk, shard)  # fmt: skip
                        return evaluations.eval_job_finish_if_done(job_id=job_id)
                    if eval_episode_ended(job_id=job.pk, task_id=task.pk, seed=job.seed * 1000 + i):
                        continue  # resumed job: this episode is done
                    _one_episode(job, task, i, policy, oracle, shard=shard)
                    evaluations.eval_job_progress(job_id=job_id)
                    if on_episode:
                        on_episode()
    except Exception as exc:
        evaluations.eval_job_fail(job_id=job_id, error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        for kind in kinds:
            discard_backend_envs(kind)
    return evaluations.eval_job_finish_if_done(job_id=job_id)


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
    job = evaluations.eval_job_create(
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


def eval_shard_waiting(*, run_id: int, index: int) -> str | None:
    """A scheduled evaluation shard of the run waiting in the queue for slot `index` (its
    label; None: none). The slot hands over at once, between episodes, instead of at the
    end of its time slice: a freed worker takes the oldest task queued, the shard."""
    jobs = EvalJob.objects.filter(run_id=run_id, status__in=UNDER_WAY, shards__gt=index)
    waiting = [
        eval_shard_work(job_id=pk, shard=index, shards=shards)
        for pk, shards in jobs.exclude(scope="").values_list("pk", "shards")
    ]
    if not waiting:
        return None
    client = redis_client()
    try:
        return next((w.label for w in waiting if client.exists(w.pending_key)), None)
    finally:
        client.close()


def eval_shard_serve(*, job_id: int, shard: int, shards: int) -> str:
    """Run one shard of a scheduled job while holding its lease, so the watchdog can tell a
    shard whose worker died (no lease, nothing queued) and enqueue it again; the shard then
    resumes, skipping the episodes that already ended."""
    work = eval_shard_work(job_id=job_id, shard=shard, shards=shards)
    keeper = work_hold(work, holder=holder_name(work.label))
    if isinstance(keeper, str):
        return f"{work.label} is held by {keeper}"
    try:
        job = EvalJob.objects.get(pk=job_id)
        evaluations.eval_episodes_cut_end(
            job_id=job_id,
            task_names=eval_shard_tasks(job=job, shard=shard, shards=shards),
            where=f"{work.label} on {socket.gethostname()}",
        )
        job = eval_job_run(job_id=job_id, shard=shard, shards=shards)
    finally:
        keeper.finish()
    # A failed job raised above with its own error; the next version's publication
    # schedules after it.
    eval_job_next(job=job)
    return f"{work.label}: {job.done}/{job.total}"


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


def _run_config(job: EvalJob) -> RunConfig:
    """The run's settings; the defaults for an evaluation outside a run."""
    return job.run.cfg if job.run is not None else RunConfig()


def _episode_config(job: EvalJob, seed: int) -> EpisodeConfig:
    """The run's rollout settings (the defaults for an evaluation outside a run) with the
    job's decoding, in the image geometry of the checkpoint under evaluation."""
    cfg = _run_config(job)
    checkpoint, _ = resolve_checkpoint(job.policy)
    return episode_config(
        cfg,
        step_cap=cfg.curation.default_step_cap,
        seed=seed,
        temperature=0.0 if job.greedy else job.temperature,
        geometry=QWEN25_VL if checkpoint is None else ImageGeometry.from_policy_dir(checkpoint),
    )


def _one_episode(
    job: EvalJob,
    task: Task,
    i: int,
    policy: PolicyEndpoint,
    oracle: OracleEndpoint | None,
    *,
    shard: int = 0,
) -> None:
    """One episode through the slots' runner (workers.episode_runner); a policy that did not
    answer fails the job (raised), as nothing else it scores would mean anything."""
    seed = job.seed * 1000 + i  # the same seeds for every policy: comparable cells
    config = _episode_config(job, seed)
    traj = evaluations.eval_trajectory_start(
        job=job, task=task, seed=seed, step_cap=config.step_cap
    )
    outcome = episode_run(
        trajectory_id=traj.pk,
        task=task.spec(seed),
        env=TaskEnv(
            backend=task.env_kind,
            env_config=task.env_config,
            env=_run_config(job).env,
            index=shard,  # an osworld task without its own VM takes the run's VM of this shard
            oracle=oracle,
        ),
        policy=policy,
        recorder=DbRecorder(traj.pk),
        config=config,
    )
    if isinstance(outcome.error, InferenceError):
        raise outcome.error
