"""Evaluation jobs: a policy on a task set, k episodes per task with fixed seeds, through the
same environments, prompts, episode runner and inference server code as training.

Evaluation trajectories are stored like any other (inspectable step by step) with
purpose=eval: they never enter training batches or task statistics. Environment errors
are recorded on their trajectory and reported apart, never counted as policy failures.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from celery import current_app as celery_app
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.imaging import QWEN25_VL, ImageGeometry
from core.protocol import TaskSpec
from datamanager.config import RunConfig
from datamanager.eval_metrics import summary
from datamanager.models import EvalJob, EvalStatus, PolicyVersion, Purpose, Run, Task, Trajectory
from datamanager.policies import ORACLE_POLICY, PolicyNotFound, policy_path
from datamanager.selectors.evaluations import eval_job_task_results
from datamanager.services import episodes
from envmanager.oracle_policy import ObservedEnv, OracleEndpoint
from rollout.client import InferenceError, PolicyClient
from rollout.episode import EpisodeConfig, PolicyEndpoint, run_episode
from rollout.local_server import LocalPolicyServer
from workers.config_mapping import episode_config
from workers.slot_worker import DbRecorder, discard_env, process_env

log = logging.getLogger("dartboard.evaluate")


class EvalSetupError(Exception):
    """The evaluation could not run (bad policy, no tasks, server failed to start)."""


def resolve_checkpoint(policy: str) -> tuple[Path | None, int | None]:
    """(checkpoint dir, version) for 'oracle' (None), 'run:ID:vN' or a local directory."""
    if policy == ORACLE_POLICY:
        return None, None
    if policy.startswith("run:"):
        try:
            _, run_id, v = policy.split(":")
            pv = PolicyVersion.objects.get(run_id=int(run_id), version=int(v.lstrip("v")))
        except (ValueError, PolicyVersion.DoesNotExist):
            raise EvalSetupError(
                f"policy {policy!r}: no such run policy version (use run:ID:vN)"
            ) from None
        return Path(pv.checkpoint), pv.version
    try:
        return policy_path(policy), None
    except PolicyNotFound as exc:
        raise EvalSetupError(str(exc)) from None


def select_tasks(spec: str) -> list[Task]:
    """'split:eval', 'tag:click' or a comma-separated list of task names."""
    if spec.startswith("split:"):
        tasks = list(Task.objects.filter(split=spec.removeprefix("split:")))
    elif spec.startswith("tag:"):
        tag = spec.removeprefix("tag:")
        tasks = [t for t in Task.objects.all() if tag in t.tags]
    else:
        names = [n for n in spec.split(",") if n]
        tasks = list(Task.objects.filter(name__in=names))
        missing = sorted(set(names) - {t.name for t in tasks})
        if missing:
            raise EvalSetupError(f"unknown task(s): {', '.join(missing)}")
    if not tasks:
        raise EvalSetupError(f"task selection {spec!r} matches no task")
    return sorted(tasks, key=lambda t: t.name)


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
    )


@contextlib.contextmanager
def _policy_endpoint(job: EvalJob) -> Iterator[tuple[PolicyEndpoint, OracleEndpoint | None]]:
    checkpoint, version = resolve_checkpoint(job.policy)
    if checkpoint is None:
        oracle = OracleEndpoint(geometry=QWEN25_VL)
        yield oracle, oracle
        return
    log_path = settings.LOG_ROOT / f"eval-{job.pk}-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with LocalPolicyServer(checkpoint, version=version or 0, log_path=log_path) as url:
        client = PolicyClient(url, timeout=120)
        try:
            yield client, None
        finally:
            client.close()


def eval_job_run(
    *, job_id: int, on_episode: Callable[[], None] | None = None, shard: int = 0, shards: int = 1
) -> EvalJob:
    """Run the job's episodes (this shard's tasks) here, one env per backend; whoever
    finishes the last episode writes the report."""
    job = EvalJob.objects.get(pk=job_id)
    EvalJob.objects.filter(pk=job_id).update(status=EvalStatus.RUNNING, error="")
    tasks = list(Task.objects.filter(name__in=job.task_names).order_by("name"))[shard::shards]
    kinds = sorted({t.env_kind for t in tasks})
    try:
        with _policy_endpoint(job) as (policy, oracle):
            for task in tasks:
                for i in range(job.k):
                    if (
                        Trajectory.objects.filter(eval_job=job, task=task, seed=job.seed * 1000 + i)
                        .exclude(status="running")
                        .exists()
                    ):
                        continue  # resumed job: this episode is done
                    _one_episode(job, task, i, policy, oracle)
                    EvalJob.objects.filter(pk=job_id).update(done=_done(job))
                    if on_episode:
                        on_episode()
    except Exception as exc:
        EvalJob.objects.filter(pk=job_id).update(
            status=EvalStatus.FAILED, error=f"{type(exc).__name__}: {exc}"
        )
        raise
    finally:
        for kind in kinds:
            discard_env(kind)
    if _done(job) >= job.total:
        report = eval_report(job_id=job_id)
        EvalJob.objects.filter(pk=job_id).update(
            status=EvalStatus.FINISHED, report=report, finished_at=timezone.now(), done=_done(job)
        )
    return EvalJob.objects.get(pk=job_id)


def eval_schedule_for_version(*, run_id: int, version: int) -> EvalJob | None:
    """Scheduled evaluation inside a run: every N-th version on the run's eval split."""
    run = Run.objects.get(pk=run_id)
    cfg = RunConfig.from_dict(run.config)
    n = cfg.evaluation.every_n_versions
    if not n or version % n:
        return None
    tasks = list(
        Task.objects.filter(split="eval", env_kind__in=cfg.tasks.env_kinds).order_by("name")
    )
    if not tasks:
        return None
    job = eval_job_create(
        name=f"{run.name} v{version}",
        policy=f"run:{run_id}:v{version}",
        tasks=tasks,
        k=cfg.evaluation.k,
        greedy=cfg.evaluation.greedy,
        run_id=run_id,
        policy_version=version,
    )
    slots = cfg.env.miniwob_slots + cfg.env.desktop_slots
    shards = max(1, min(len(tasks), round(cfg.evaluation.slot_share * slots)))

    def enqueue() -> None:
        for shard in range(shards):
            celery_app.send_task(
                "workers.tasks.eval_shard", args=(job.pk, shard, shards), queue="env"
            )

    transaction.on_commit(enqueue)
    return job


def _done(job: EvalJob) -> int:
    return Trajectory.objects.filter(eval_job=job).exclude(status="running").count()


def _episode_config(job: EvalJob, seed: int) -> EpisodeConfig:
    """The run's rollout settings (the defaults for an evaluation outside a run) with the
    job's decoding, in the image geometry of the checkpoint under evaluation."""
    cfg = RunConfig.from_dict(job.run.config) if job.run_id else RunConfig()
    checkpoint, _ = resolve_checkpoint(job.policy)
    return episode_config(
        cfg,
        step_cap=cfg.curation.default_step_cap,
        seed=seed,
        temperature=0.0 if job.greedy else job.temperature,
        geometry=QWEN25_VL if checkpoint is None else ImageGeometry.from_policy_dir(checkpoint),
    )


def _one_episode(
    job: EvalJob, task: Task, i: int, policy: PolicyEndpoint, oracle: OracleEndpoint | None
) -> None:
    seed = job.seed * 1000 + i  # the same seeds for every policy: comparable cells
    config = _episode_config(job, seed)
    with transaction.atomic():
        traj = Trajectory.objects.create(
            task=task,
            run=job.run,
            purpose=Purpose.EVAL,
            eval_job=job,
            instruction=task.instruction,
            seed=seed,
            step_cap=config.step_cap,
        )
    spec = TaskSpec(
        name=task.name,
        env_kind=task.env_kind,
        env_config=task.env_config,
        instruction=task.instruction,
        seed=seed,
    )
    try:
        env = process_env(task.env_kind)
        if oracle is not None:
            env = ObservedEnv(env, oracle)
        result = run_episode(
            env=env, policy=policy, recorder=DbRecorder(traj.pk), task=spec, config=config
        )
    except InferenceError as exc:
        episodes.trajectory_finish(
            trajectory_id=traj.pk, status="error", reward=None, error=f"inference: {exc}"
        )
        raise
    except Exception as exc:
        episodes.trajectory_finish(
            trajectory_id=traj.pk, status="error", reward=None, error=f"{type(exc).__name__}: {exc}"
        )
        discard_env(task.env_kind)
        return
    episodes.trajectory_finish(
        trajectory_id=traj.pk,
        status=result.status,
        reward=result.reward,
        details=result.details,
        env_ms=result.env_ms,
        model_ms=result.model_ms,
    )


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
