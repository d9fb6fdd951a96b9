"""Writes of evaluation jobs: the job, its progress and report, its trajectories."""

from __future__ import annotations

from collections.abc import Collection

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from datamanager.models import EvalJob, EvalStatus, Purpose, Task, Trajectory
from datamanager.policies import EvalSetupError, resolve_checkpoint
from datamanager.selectors.evaluations import eval_job_done, eval_report


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
    from datamanager.services.episodes import trajectories_abort_cut

    return trajectories_abort_cut(
        Trajectory.objects.filter(eval_job_id=job_id, task__name__in=list(task_names)),
        error=f"the evaluation's worker stopped mid-episode; {where} resumed it",
    )
