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
import time
import uuid

from celery import current_app as celery_app
from django.db import transaction

from datamanager.config import RunConfig
from datamanager.events import publish_on_commit
from datamanager.models import PolicyVersion, Run, RunStatus
from datamanager.services import batches
from datamanager.services.runs import run_set_message
from workers.dbutil import refresh_connection
from workers.runs import router_sync
from workers.training_loop import get_trainer, update_config

log = logging.getLogger("dartboard.sync")


def slot_list(cfg: RunConfig) -> list[tuple[str, int]]:
    return [("miniwob", i) for i in range(cfg.env.miniwob_slots)] + [
        ("desktop", i) for i in range(cfg.env.desktop_slots)
    ]


def sync_round(*, run: Run, cfg: RunConfig, episode_timeout_s: float) -> bool:
    """One round. Returns False when the run is no longer running."""
    trainer = get_trainer(run, cfg)
    run_set_message(
        run_id=run.pk, message=f"synchronous round: rolling out on {len(slot_list(cfg))} slots"
    )
    slots = slot_list(cfg)
    lockstep = None
    if cfg.sync_lockstep:
        lockstep = {
            "key": f"dartboard:lockstep:{run.pk}:{uuid.uuid4().hex}",
            "members": len(slots),
            "timeout_s": cfg.env.step_timeout_s + cfg.rollout.request_timeout_s,
        }
    results = [
        celery_app.send_task(
            "workers.tasks.episode_once", args=(run.pk, backend, i, lockstep), queue="env"
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
    run_set_message(
        run_id=run.pk, message=f"synchronous round: training on {len(batch.samples)} steps"
    )
    trained_version = trainer.state.version
    metrics = trainer.update(batch.samples, update_config(cfg))
    path = trainer.save_version(trained_version + 1)
    with transaction.atomic():
        update = batches.batch_commit(
            run=run, batch=batch, metrics=metrics, trained_version=trained_version, kind="sync"
        )
        PolicyVersion.objects.create(run=run, version=trained_version + 1, checkpoint=str(path))
        publish_on_commit(
            run_id=run.pk, kind="update", data={"number": update.number, "metrics": update.metrics}
        )
    # Every worker loads at once; the next round waits for it (the synchronous baseline).
    router_sync(run_id=run.pk, checkpoint=path, version=trained_version + 1, rolling=False)
    return True


def sync_for(*, run_id: int, max_seconds: float, stop: threading.Event | None = None) -> str:
    """Run rounds until the run stops, max_updates is reached, the time slice ends or `stop`
    is set (this worker lost the run's trainer lease)."""
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return "trainer lease lost"
        refresh_connection()
        run = Run.objects.get(pk=run_id)
        if run.status != RunStatus.RUNNING:
            return f"run is {run.status}"
        cfg = RunConfig.from_dict(run.config)
        if (
            cfg.trainer.max_updates
            and get_trainer(run, cfg).state.updates >= cfg.trainer.max_updates
        ):
            return "max_updates reached"
        timeout = cfg.rollout.request_timeout_s * 40 + 600
        if not sync_round(run=run, cfg=cfg, episode_timeout_s=timeout):
            return "run stopped"
    return "time slice over"
