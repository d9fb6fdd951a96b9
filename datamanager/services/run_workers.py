"""A run's workers: started with the run, ended when they stop, pointed at its policy.

`run_apply` starts, pauses, resumes or stops a run for every way in (the dashboard, the API,
a sweep, the host agent, `manage.py start_run`); starting or resuming enqueues the run's slot
and trainer tasks after commit, by name (datamanager/live_work.py). `run_orphans_abort` ends
the episodes of env workers that stopped; `router_sync` tells the run's router which policy
version to serve.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, transaction

from datamanager.config import RunConfig
from datamanager.live_work import (
    REDIS_DOWN,
    eval_shard_work,
    redis_client,
    run_live_work,
    work_enqueue,
)
from datamanager.models import PolicyVersion, Run, RunStatus
from datamanager.policies import ORACLE_POLICY, PolicyNotFound
from datamanager.selectors.evaluations import eval_jobs_under_way
from datamanager.selectors.runs import (
    processes_per_run,
    run_current_policy,
    run_holding_shared_workers,
    run_router_url,
)
from datamanager.services import episodes
from datamanager.services.placement import placement_queue
from datamanager.services.runs import (
    InvalidTransition,
    NotYourRun,
    run_action_record,
    run_control,
    run_control_check,
    run_set_message,
)
from datamanager.services.versions import policy_version_add_reach
from rollout.client import RouterAdmin

if TYPE_CHECKING:
    from core.weight_wire import WeightSource

log = logging.getLogger(__name__)


# The transaction-scoped PostgreSQL advisory lock a model run's start takes on the shared
# inference workers, so that two starts at once cannot both find them free.
SHARED_WORKERS_LOCK = 0x44617274


class RunNotStartable(Exception):
    """A run cannot start; the message says why (no tasks, no checkpoint...)."""


def run_apply(*, run_id: int, action: str, user: User | None = None) -> Run:
    """start/pause/resume/stop a run; starting or resuming also starts its workers.

    All or nothing: a run whose workers cannot start stays as it was, with the reason raised
    as InvalidTransition, RunNotStartable or NotYourRun (`user` is not its owner nor an
    admin). Every attempt is recorded with who and when, the refused ones too."""
    per_run = processes_per_run()
    try:
        with transaction.atomic():
            run_control_check(run=Run.objects.select_related("owner").get(pk=run_id), user=user)
            run = run_control(run_id=run_id, action=action, queue=per_run)
            if run.status == RunStatus.QUEUED:
                # A host agent brings up its processes, then starts its workers (run_begin).
                placement_queue(run_id=run_id)
                run_set_message(run_id=run_id, message="queued: waiting for a host agent")
            elif run.status == RunStatus.RUNNING:
                if not per_run:
                    _check_inference_free(run)
                try:
                    run_start_workers(run_id=run_id)
                except (episodes.NoTasks, PolicyNotFound) as exc:
                    raise RunNotStartable(str(exc)) from None
    except (InvalidTransition, RunNotStartable, NotYourRun) as exc:
        run_action_record(run_id=run_id, action=action, user=user, outcome=f"refused: {exc}")
        raise
    run_action_record(run_id=run_id, action=action, user=user, outcome=run.status)
    return run


def _check_inference_free(run: Run) -> None:
    """The shared inference workers (DARTBOARD_PROCESSES=shared, or auto with no host agent
    reporting) serve one run's policy at a time: a second model run would silently switch
    the first one's weights under it, so it is refused, naming the run that holds them.
    Runs with their own processes (a host agent's) each have their own workers."""
    if run.cfg.policy == ORACLE_POLICY:
        return  # the scripted oracle uses no inference worker
    if connection.vendor == "postgresql":
        # Two starts at once would each find no holder and both run: the second waits here
        # until the first commits, and then finds it. (SQLite lets one writer at a time.)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [SHARED_WORKERS_LOCK])
    holder = run_holding_shared_workers(besides=run.pk)
    if holder is not None:
        raise RunNotStartable(
            f"run #{holder.pk} {holder.name!r} is {holder.status} on the shared inference "
            "workers, which serve one model at a time (a second model run would switch its "
            "weights): stop it first, or give every run its own processes with a host agent "
            "(DARTBOARD_PROCESSES=per-run)"
        )


def run_start_workers(*, run_id: int) -> None:
    """After a run starts or resumes: task stats, env slot tasks, the trainer task, and the
    router pointed at the run's current policy. Tasks are enqueued after commit."""
    run = Run.objects.get(pk=run_id)
    cfg = run.cfg
    episodes.taskstats_ensure(run=run)
    run_orphans_abort(run_id=run_id, cfg=cfg)
    scripted = cfg.policy == ORACLE_POLICY  # the scripted oracle: no model, nothing to train
    version, checkpoint = (0, "") if scripted else run_current_policy(run=run)

    def enqueue() -> None:
        if not scripted:
            router_sync(run_id=run_id, checkpoint=checkpoint, version=version)
        for work in run_live_work(run_id=run_id, cfg=cfg):
            work_enqueue(work)

    transaction.on_commit(enqueue)


def run_orphans_abort(*, run_id: int, cfg: RunConfig) -> int:
    """End the episodes of env workers that stopped: no heartbeat on their slot row for
    `env.silent_after_s` and no live lease in Redis (either alone is an outage of the
    database or of Redis, not a dead worker). With Redis away, the heartbeat decides.
    An evaluation episode ends only when none of its scheduled job's shards holds its lease
    (with Redis away, none ends: it has no heartbeat to judge by)."""
    alive: set[str] = set()
    dead_jobs: list[int] = []
    client = redis_client()
    try:
        keys = [work.lease_key for work in run_live_work(run_id=run_id, cfg=cfg)]
        # One round trip for every lease (1,000 slots were 1,000 round trips a pass).
        for holder in client.mget(keys) if keys else []:
            if holder is not None:
                alive.add(holder.decode() if isinstance(holder, bytes) else str(holder))
        for job_id, shards in eval_jobs_under_way(run_id=run_id):
            leases = [
                eval_shard_work(job_id=job_id, shard=s, shards=shards).lease_key
                for s in range(shards)
            ]
            if not any(client.mget(leases)):
                dead_jobs.append(job_id)
    except REDIS_DOWN as exc:
        log.warning("run %s: slot leases unreadable (%s); judging by heartbeats alone", run_id, exc)
    finally:
        client.close()
    return episodes.trajectories_abort_orphans(
        run_id=run_id,
        stale_after_s=cfg.env.silent_after_s,
        alive_slots=alive,
        dead_eval_jobs=dead_jobs,
    )


def router_sync(
    *,
    run_id: int,
    checkpoint: str | Path,
    version: int,
    rolling: bool = True,
    weights: WeightSource | None = None,
) -> None:
    """Ask the router to load `version` on its workers: rolling (one worker at a time, the
    decoupled design) or all at once (the synchronous baseline); pulled from the trainer's
    weight server `weights` where given, else (and where a pull fails) from `checkpoint`. A
    failure is said on the run (the dashboard shows it) and logged; the next publish tries
    again."""
    try:
        RouterAdmin(run_router_url(run_id=run_id), token=settings.DARTBOARD_ADMIN_TOKEN).sync(
            checkpoint=str(checkpoint),
            version=version,
            run=run_id,
            rolling=rolling,
            weights=weights,
        )
    except Exception as exc:
        log.warning("run %s: router not told about version %s: %s", run_id, version, exc)
        run_set_message(
            run_id=run_id, message=f"router unreachable for policy version {version}: {exc}"
        )


def policy_version_record_reach(*, run_id: int) -> None:
    """Record on the run's newest PolicyVersion which inference workers now serve it (from
    the router). Best effort: an unreachable router changes nothing."""
    latest = PolicyVersion.objects.filter(run_id=run_id).order_by("-version").first()
    if latest is None:
        return
    try:
        with RouterAdmin(
            run_router_url(run_id=run_id), timeout=3, token=settings.DARTBOARD_ADMIN_TOKEN
        ) as admin:
            serving = [w.url for w in admin.workers() if w.policy_version == latest.version]
    except Exception:
        return
    policy_version_add_reach(version_id=latest.pk, workers=serving)
