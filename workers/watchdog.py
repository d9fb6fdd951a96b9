"""The runs watchdog: live work whose worker died is started again.

Celery beat calls `watchdog_pass` every DARTBOARD_WATCHDOG_PERIOD_S (task
`workers.tasks.runs_watchdog` on queue `default`; `make run`'s launcher starts beat).
For every running run it
1. ends the episodes of env workers that stopped heart-beating (`aborted`, with the reason),
   so their groups complete;
2. enqueues again each env slot task and the trainer task that has had neither a lease nor a
   pending message for DARTBOARD_WATCHDOG_GRACE_S, and says so on the run;
3. does the same for each unfinished shard of a scheduled evaluation job (the shard resumes
   where it stopped), and finishes a job whose last episode it ended in step 1 (no shard is
   left to write its report, and its run's next evaluation waits for it).

A pending marker counts as waiting work only while its message is really in the broker's
queue (or its countdown has not run out): after a Redis restart that lost the queue, or a
message stranded with a connection that died in an outage, the marker alone would otherwise
hold the work back for the visibility timeout.

Why it is needed: Celery acknowledges a task when it ends (acks_late), and a worker killed
mid-task (SIGKILL, the OOM killer, a lost machine) leaves its message unacknowledged until the
broker's visibility timeout, an hour. The supervisor restarts the worker process at once, but
without this the restarted worker would sit idle and the slot or the trainer would be gone
for that hour, with nothing on the dashboard saying so. Work that is only waiting in a queue
(a pending marker, workers/leases.py) is left alone, so a busy worker pool does not pile
up copies; a copy that does start finds the lease held and ends.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.conf import settings

from datamanager.config import RunConfig
from datamanager.live_work import (
    LiveWork,
    eval_shard_work,
    redis_client,
    run_live_work,
    work_enqueue,
)
from datamanager.models import EvalJob, EvalStatus, Run, RunStatus, TrainUpdate
from datamanager.selectors.evaluations import eval_shard_finished
from datamanager.services.evaluations import eval_job_finish_if_done, eval_job_next
from datamanager.services.run_workers import run_orphans_abort
from datamanager.services.runs import run_set_message
from workers.disk import runs_resume_after_disk
from workers.leases import QueuedTasks

log = logging.getLogger("dartboard.watchdog")


def watchdog_pass(*, now: float | None = None) -> list[str]:
    """One pass over the running runs; returns what it enqueued again ("run 3: trainer")."""
    now = time.time() if now is None else now
    restarted: list[str] = []
    client = redis_client()
    queued = QueuedTasks(client)
    try:
        for run in Run.objects.filter(status=RunStatus.RUNNING):
            cfg = run.cfg
            aborted = run_orphans_abort(run_id=run.pk, cfg=cfg)
            if aborted:
                log.warning("run %s: ended %d episodes of stopped env workers", run.pk, aborted)
            works = [
                w
                for w in run_live_work(run_id=run.pk, cfg=cfg)
                if not (w.label == "trainer" and _trainer_done(run, cfg))
            ]
            held = _held(client, works)
            for work in works:
                if work.lease_key in held or not _lapsed(client, queued, work, now):
                    continue
                work_enqueue(work)
                message = (
                    f"watchdog: the {work.label} had no live worker for "
                    f"{settings.DARTBOARD_WATCHDOG_GRACE_S:.0f} s (its worker died or was "
                    f"killed); its task ({work.task}) was enqueued again on queue {work.queue}"
                )
                log.warning("run %s: %s", run.pk, message)
                run_set_message(run_id=run.pk, message=message)
                restarted.append(f"run {run.pk}: {work.label}")
        restarted += _evaluation_pass(client, queued, now)
        restarted += [f"run {pk}: resumed, the disks have room" for pk in runs_resume_after_disk()]
    finally:
        client.close()
    return restarted


def _evaluation_pass(client: Any, queued: QueuedTasks, now: float) -> list[str]:
    """Enqueue again the unfinished shards of scheduled evaluation jobs whose worker died."""
    restarted = []
    jobs = EvalJob.objects.filter(
        shards__gt=0, status__in=(EvalStatus.QUEUED, EvalStatus.RUNNING)
    ).select_related("run")
    for job in jobs:
        works = [
            eval_shard_work(job_id=job.pk, shard=s, shards=job.shards) for s in range(job.shards)
        ]
        finished = [eval_shard_finished(job=job, shard=s) for s in range(job.shards)]
        if all(finished):
            restarted += _evaluation_close(client, job, works)
            continue
        for work, done in zip(works, finished, strict=True):
            if done or not _lapsed(client, queued, work, now):
                continue
            work_enqueue(work)
            message = (
                f"watchdog: {work.label} had no live worker for "
                f"{settings.DARTBOARD_WATCHDOG_GRACE_S:.0f} s; enqueued again (it resumes "
                "after the episodes that ended)"
            )
            log.warning("%s", message)
            if job.run is not None and job.run.status == RunStatus.RUNNING:
                run_set_message(run_id=job.run.pk, message=message)
            restarted.append(work.label)
    return restarted


def _evaluation_close(client: Any, job: EvalJob, works: list[LiveWork]) -> list[str]:
    """Finish a job whose every episode has ended while none of its shards runs. Its last
    episode was cut by a worker's death and ended `aborted` by `run_orphans_abort`, so no
    shard comes back to write its report (a resumed shard skips the ended episodes, and a
    finished shard is never enqueued again). Left under way, it would hold back every later
    scheduled evaluation of its run (one at a time, `eval_schedule_next`) and the run's end
    at trainer.max_updates."""
    if _held(client, works):
        return []  # its shard is writing the report now
    ended = eval_job_finish_if_done(job_id=job.pk)
    eval_job_next(job=ended)
    message = f"watchdog: evaluation #{job.pk} finished; its last episode's worker had died"
    log.warning("%s", message)
    if job.run is not None and job.run.status == RunStatus.RUNNING:
        run_set_message(run_id=job.run.pk, message=message)
    return [f"evaluation #{job.pk} finished"]


def _trainer_done(run: Run, cfg: RunConfig) -> bool:
    """A trainer that reached max_updates ended on purpose."""
    limit = cfg.trainer.max_updates
    return bool(limit) and TrainUpdate.objects.filter(run=run).count() >= limit


def _held(client: Any, works: list[LiveWork]) -> set[str]:
    """The lease keys of `works` that a live worker holds, read in one pipeline, and their
    missing-since markers cleared in one command (what `_lapsed` does for held work, one
    work at a time: 1,000 slots were 2,000 round trips a pass)."""
    if not works:
        return set()
    pipe = client.pipeline(transaction=False)
    for work in works:
        pipe.exists(work.lease_key)
    held = {w.lease_key for w, n in zip(works, pipe.execute(), strict=True) if n}
    if held:
        client.delete(*(f"{key}:missing-since" for key in held))
    return held


def _waiting(client: Any, queued: QueuedTasks, work: LiveWork, now: float) -> bool:
    """The work's message is in the queue, or was sent with a countdown still running."""
    due = client.get(work.pending_key)
    if due is None:
        return False
    return now < float(due) + settings.DARTBOARD_WATCHDOG_GRACE_S or queued.holds(work)


def _lapsed(client: Any, queued: QueuedTasks, work: LiveWork, now: float) -> bool:
    """True once `work` has had neither a lease nor a message waiting in the queue for the
    grace period (seen on two passes at least that far apart)."""
    marker = f"{work.lease_key}:missing-since"
    if client.exists(work.lease_key) or _waiting(client, queued, work, now):
        client.delete(marker)
        return False
    since = client.get(marker)
    if since is None:
        client.set(marker, str(now), ex=3600)
        return False
    if now - float(since) < settings.DARTBOARD_WATCHDOG_GRACE_S:
        return False
    client.delete(marker)
    return True
