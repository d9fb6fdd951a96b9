"""The synchronous batch-loop baseline DART compares against, built from the same parts:
reset a batch of environments (one episode per slot), roll every trajectory to completion
(a barrier), train on what finished, publish the version and load it on every inference
worker at once, repeat. Selected per run with `mode: synchronous`.

With `sync_lockstep` (the default) the round is a batch step loop: the episodes take their
turns together (workers.lockstep), so the policy is asked for the whole batch's actions
at once and every turn waits for the slowest environment. Without it, each slot runs its
episode freely and only the round's end is a barrier (a weaker, friendlier baseline).
"""

from __future__ import annotations

import logging
import threading
import uuid

from celery import current_app as celery_app

from datamanager.config import RunConfig
from datamanager.live_work import run_queue
from datamanager.models import Run, RunStatus
from datamanager.services import batches
from datamanager.services.runs import run_set_message
from workers.training_loop import get_trainer, run_loop, update_and_publish

log = logging.getLogger("dartboard.sync")


def sync_round(*, run: Run, cfg: RunConfig, episode_timeout_s: float) -> bool:
    """One round. Returns False when the run is no longer running."""
    trainer = get_trainer(run, cfg)
    run_set_message(
        run_id=run.pk, message=f"synchronous round: rolling out on {len(cfg.env.slots())} slots"
    )
    slots = cfg.env.slots()
    lockstep = None
    if cfg.sync_lockstep:
        lockstep = {
            "key": f"dartboard:lockstep:{run.pk}:{uuid.uuid4().hex}",
            "members": len(slots),
            "timeout_s": cfg.env.step_timeout_s + cfg.rollout.request_timeout_s,
        }
    results = [
        celery_app.send_task(
            "workers.tasks.episode_once",
            args=(run.pk, backend, i, lockstep),
            queue=run_queue(run_id=run.pk, kind="env"),
        )
        for backend, i in slots
    ]
    for result in results:  # the barrier: every trajectory to completion
        result.get(timeout=episode_timeout_s, disable_sync_subtasks=False, propagate=False)
    run.refresh_from_db()
    if run.status != RunStatus.RUNNING:
        return False
    batch = batches.batch_collect(run=run, current_version=trainer.state.version, min_groups=1)
    if batch is not None and not batch.samples and batch.empty_group_ids:
        run_set_message(
            run_id=run.pk, message="synchronous round: " + batches.batch_skip(batch=batch)
        )
    if batch is None or not batch.samples:
        return True
    batches.pool_mix(
        batch=batch,
        run=run,
        cfg=cfg,
        current_version=trainer.state.version,
        seed=trainer.state.updates,
    )
    run_set_message(
        run_id=run.pk, message=f"synchronous round: training on {len(batch.samples)} steps"
    )
    # Every worker loads the new version at once; the next round waits for it.
    update_and_publish(
        run=run,
        cfg=cfg,
        trainer=trainer,
        batch=batch,
        kind="sync",
        publish=True,
        rolling=False,
    )
    return True


def sync_for(*, run_id: int, max_seconds: float, stop: threading.Event | None = None) -> str:
    """The synchronous driver's time slice: rounds until the run loop ends it."""

    def body(run: Run, cfg: RunConfig) -> str | None:
        timeout = cfg.rollout.request_timeout_s * 40 + 600
        return None if sync_round(run=run, cfg=cfg, episode_timeout_s=timeout) else "run stopped"

    return run_loop(run_id=run_id, max_seconds=max_seconds, stop=stop, body=body)
