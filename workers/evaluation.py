"""Evaluation jobs: a policy on a task set, k episodes per task with fixed seeds, through the
same environments, prompts, episode runner and inference server code as training.

Evaluation trajectories are stored like any other (inspectable step by step) with
purpose=eval: they never enter training batches or task statistics. Environment errors
are recorded on their trajectory and reported apart, never counted as policy failures. An
episode ends as a slot's does (workers.episode_runner): the database or the object storage
away past the retry budget ends it `error` ("database: ...", "storage: ...") and the job
goes on; a policy that does not answer fails the job.

Which job runs when (a run's scheduled evaluations, `eval_start`) is decided by
datamanager/services/evaluations.py; this module runs a job's episodes.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

from django.conf import settings

from core.imaging import QWEN25_VL
from datamanager.config import RunConfig
from datamanager.live_work import eval_shard_work, redis_client
from datamanager.models import EvalJob, EvalStatus, Task
from datamanager.policies import (
    ORACLE_POLICY,
    checkpoint_prompt_counter,
    policy_prompt_counter,
    resolve_checkpoint,
)
from datamanager.roles import run_env_check
from datamanager.selectors.evaluations import eval_episode_ended, eval_shard_tasks
from datamanager.services import evaluations
from envmanager.oracle_policy import OracleEndpoint
from rollout.auth import ServiceTokens
from rollout.client import InferenceError, PolicyClient
from rollout.episode import EpisodeConfig, PolicyEndpoint
from rollout.local_server import LocalPolicyServer
from workers.config_mapping import episode_config
from workers.env_cache import TaskEnv, discard_backend_envs
from workers.episode_runner import DbRecorder, episode_run
from workers.leases import holder_name, work_hold
from workers.lifecycle import shutdown_requested

log = logging.getLogger("dartboard.evaluate")


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
                        log.info(
                            "evaluation %s shard %s: left for the worker's shutdown", job.pk, shard
                        )
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


def eval_shard_waiting(*, run_id: int, index: int) -> str | None:
    """A scheduled evaluation shard of the run waiting in the queue for slot `index` (its
    label; None: none). The slot hands over at once, between episodes, instead of at the
    end of its time slice: a freed worker takes the oldest task queued, the shard."""
    jobs = EvalJob.objects.filter(run_id=run_id, status__in=evaluations.UNDER_WAY, shards__gt=index)
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
    evaluations.eval_job_next(job=job)
    return f"{work.label}: {job.done}/{job.total}"


def _run_config(job: EvalJob) -> RunConfig:
    """The run's settings; the defaults for an evaluation outside a run."""
    return job.run.cfg if job.run is not None else RunConfig()


def _episode_config(job: EvalJob, seed: int) -> EpisodeConfig:
    """The run's rollout settings (the defaults for an evaluation outside a run) with the
    job's decoding, with the processor (image geometry, tokenizer) of the checkpoint under
    evaluation."""
    cfg = _run_config(job)
    checkpoint, _ = resolve_checkpoint(job.policy)
    return episode_config(
        cfg,
        step_cap=cfg.curation.default_step_cap,
        seed=seed,
        temperature=0.0 if job.greedy else job.temperature,
        counter=(
            policy_prompt_counter(ORACLE_POLICY)
            if checkpoint is None
            else checkpoint_prompt_counter(checkpoint)
        ),
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
