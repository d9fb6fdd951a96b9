"""The trainer worker's loop for one run (called by the Celery task on queue `train`).

Waits for ready groups (and says on the run what it waits for: it never hangs silently),
builds a batch, updates the model, records the update, and every `checkpoint_every`
updates publishes a PolicyVersion that the router syncs to the inference workers one at a
time: pulled from the run's weight server in this process (`training.weight_server`, at
DARTBOARD_WEIGHT_SERVER) by the workers that pull, from its checkpoint by the others. A
restarted trainer resumes from the newest published checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from django.conf import settings
from django.db import transaction

from core.weight_wire import WeightSource
from datamanager.config import RunConfig
from datamanager.events import publish_on_commit
from datamanager.live_work import trainer_work, work_enqueue
from datamanager.models import (
    GroupStatus,
    PolicyVersion,
    Run,
    RunStatus,
    TaskGroup,
    Trajectory,
    TrajectoryStatus,
)
from datamanager.policies import policy_path
from datamanager.services import batches
from datamanager.services.evaluations import eval_schedule_next, run_finish_if_done
from datamanager.services.run_workers import (
    policy_version_record_reach,
    router_sync,
    run_orphans_abort,
)
from datamanager.services.runs import run_set_message
from datamanager.services.versions import policy_version_create
from training.config import RENDEZVOUS_ENV, REPLICAS_ENV, SHARD_ENV
from training.memory_plan import budget_sample, run_trainer_request, trainer_layout
from training.replica_group import ReplicaGroup, TrainerSpec
from training.trainer import PolicyTrainer, version_dir
from training.update import UpdateInterrupted
from training.weight_server import WeightServer
from workers.artifacts import (
    checkpoint_restore,
    checkpoint_upload,
    optimizer_states_prune,
    versions_prune,
)
from workers.dbutil import db_retry, is_outage, refresh_connection
from workers.disk import is_disk_full, run_pause_for_disk, version_tmp_remove
from workers.exports import export_update
from workers.leases import holder_name, work_hold
from workers.lifecycle import shutdown_requested

log = logging.getLogger("dartboard.trainer")

_TRAINERS: dict[int, PolicyTrainer] = {}  # one per run in this worker process
_GROUPS: dict[int, ReplicaGroup] = {}  # a run's trainer replicas (trainer.replicas > 1)
_WEIGHT_SERVERS: dict[int, WeightServer] = {}  # a run's newest version, served to its workers

SLICE_SECONDS = 600.0
RETRY_SECONDS = 30.0


def get_trainer(run: Run, cfg: RunConfig) -> PolicyTrainer:
    trainer = _TRAINERS.get(run.pk)
    if trainer is None:
        import torch

        # Measured here: with the env workers and inference on the same 2 cores, 2 torch
        # threads ran ~10x slower than 1 (oversubscription). GPU hosts are unaffected.
        torch.set_num_threads(settings.DARTBOARD_TORCH_THREADS)
        run_dir = settings.CHECKPOINT_ROOT / f"run-{run.pk}"
        checkpoint_restore(run=run, run_dir=run_dir)  # a new host fetches the newest version
        published = list(PolicyVersion.objects.filter(run=run).values_list("version", flat=True))
        replicas, sharded = trainer_layout_here(cfg)
        config = cfg.trainer
        if replicas > 1:  # its auto settings decided
            config = dataclasses.replace(
                config, replicas=replicas, shard="on" if sharded else "off"
            )
        spec = TrainerSpec(
            config=config,
            start_checkpoint=str(policy_path(cfg.policy)),
            run_dir=str(run_dir),
            published_versions=published,
            sample=budget_sample(
                policy_path(cfg.policy),
                max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                max_new_tokens=cfg.rollout.max_new_tokens,
                max_images=cfg.rollout.max_images,
            ),
        )
        if replicas > 1:
            # Replicas on other hosts join at the rendezvous the run's placement gave this
            # worker (`hostagent.cluster`); without one, they are this worker's children.
            group = _GROUPS[run.pk] = ReplicaGroup.start(
                spec, world=replicas, rendezvous=os.environ.get(RENDEZVOUS_ENV, "")
            )
            trainer = group.trainer
        else:
            trainer = spec.build(None, device="cuda" if torch.cuda.is_available() else "cpu")
        _TRAINERS[run.pk] = trainer
    return trainer


def trainer_layout_here(cfg: RunConfig) -> tuple[int, bool]:
    """(replicas, sharded) of the run's trainer: as its host agent's placement decided them
    (DARTBOARD_TRAINER_REPLICAS, DARTBOARD_TRAINER_SHARD), else (the shared stack) for this
    host's GPUs (`training.memory_plan.trainer_layout`)."""
    import torch

    placed = os.environ.get(REPLICAS_ENV)
    if placed:
        return int(placed), os.environ.get(SHARD_ENV) == "1"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    request, gpu_gib = None, None
    if gpus and cfg.trainer.replicas != 1:
        r = cfg.rollout
        request = run_trainer_request(
            policy_path(cfg.policy),
            cfg.trainer,
            max_prompt_tokens=r.max_prompt_tokens,
            max_new_tokens=r.max_new_tokens,
            max_images=r.max_images,
        )
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 1024**3
    return trainer_layout(cfg.trainer, request, gpu_gib=gpu_gib, gpus=gpus)


def trainer_forget(*, run_id: int) -> None:
    """Drop this process's trainer of a run; the next get_trainer resumes from its newest
    published checkpoint (after a failed update the weights in memory are not trusted)."""
    _TRAINERS.pop(run_id, None)
    group = _GROUPS.pop(run_id, None)
    if group is not None:
        group.close()
    server = _WEIGHT_SERVERS.pop(run_id, None)
    if server is not None:  # its workers load the versions they lack from checkpoints
        server.close()


def trainer_held(*, run_id: int) -> PolicyTrainer | None:
    """This process's trainer of a run, if it holds one."""
    return _TRAINERS.get(run_id)


def replica_group_held(*, run_id: int) -> ReplicaGroup | None:
    """This process's trainer replicas of a run, if it started them."""
    return _GROUPS.get(run_id)


def trainers_forget_all() -> None:
    """Drop every trainer this process holds (a test's end, a worker's shutdown)."""
    for run_id in list(_TRAINERS) + list(_GROUPS):
        trainer_forget(run_id=run_id)


def _waiting_message(run: Run, cfg: RunConfig) -> str:
    ready = TaskGroup.objects.filter(run=run, status=GroupStatus.READY).count()
    running = Trajectory.objects.filter(run=run, status=TrajectoryStatus.RUNNING).count()
    return (
        f"trainer waiting for {cfg.trainer.min_groups} ready groups: {ready} ready, "
        f"{running} trajectories running"
    )


def run_loop(
    *,
    run_id: int,
    max_seconds: float,
    stop: threading.Event | None,
    body: Callable[[Run, RunConfig], str | None],
) -> str:
    """The one skeleton of the decoupled trainer and the synchronous driver: call `body`
    until the run stops, max_updates is reached, the time slice ends, the worker shuts
    down or `stop` is set (this worker lost the run's trainer lease). `body` returns a
    reason to end the slice, or None to go on."""
    deadline = time.monotonic() + max_seconds
    run: Run | None = None
    while time.monotonic() < deadline:
        if shutdown_requested.is_set():
            return "time slice over"  # re-enqueued: a restarted worker resumes the run
        if stop is not None and stop.is_set():
            return "trainer lease lost"
        refresh_connection()
        # One Run for the slice, reloaded each turn: its settings are parsed again only when
        # they changed (`Run.cfg`).
        if run is None:
            run = Run.objects.get(pk=run_id)
        else:
            run.refresh_from_db()
        if run.status != RunStatus.RUNNING:
            return f"run is {run.status}"
        cfg = run.cfg
        trainer = get_trainer(run, cfg)
        if cfg.trainer.max_updates and trainer.state.updates >= cfg.trainer.max_updates:
            run_set_message(run_id=run_id, message=f"trainer done: {trainer.state.updates} updates")
            run_finish_if_done(run_id=run_id)
            return "max_updates reached"
        reason = body(run, cfg)
        if reason is not None:
            return reason
    return "time slice over"


def weights_serve(*, run_id: int, trainer: PolicyTrainer, version: int) -> WeightSource | None:
    """Serve the weights the trainer holds now as `version` from this process's weight
    server for the run (started on first use), so workers pull them over the network; None
    where none runs (DARTBOARD_WEIGHT_SERVER off, or a sharded trainer). A failure is said
    on the run and leaves the checkpoint as the only way: a sync never waits on it."""
    if not settings.DARTBOARD_WEIGHT_SERVER or trainer.sharded:
        return None
    try:
        server = _WEIGHT_SERVERS.get(run_id)
        if server is None:
            server = _WEIGHT_SERVERS[run_id] = WeightServer(host=settings.DARTBOARD_WEIGHT_SERVER)
        kind, tensors = trainer.served_weights()
        return server.publish(
            version=version, kind=kind, tensors=tensors, dtype=trainer.served_dtype
        )
    except Exception as exc:
        log.warning(
            "run %s: version %s not served over the network", run_id, version, exc_info=True
        )
        run_set_message(
            run_id=run_id,
            message=f"version {version} not served over the network ({type(exc).__name__}: "
            f"{exc}); inference workers load its checkpoint",
        )
        return None


def policy_version_publish(
    *,
    run: Run,
    version: int,
    checkpoint: Path,
    artifact: str = "",
    rolling: bool = True,
    weights: WeightSource | None = None,
) -> PolicyVersion:
    """Publish a trained version; call inside the update's transaction. After commit the
    router loads it (one worker at a time, or all at once for the synchronous baseline,
    which then waits for it): pulled from `weights` (this process's weight server) by the
    workers that pull, else by its artifact reference, so every inference host fetches it
    from the store. The run's next scheduled evaluation is enqueued unless one is under way
    (`datamanager.services.evaluations.eval_schedule_next`)."""
    published = policy_version_create(
        run=run, version=version, checkpoint=checkpoint, artifact=artifact
    )
    eval_schedule_next(run_id=run.pk)
    transaction.on_commit(
        functools.partial(
            router_sync,
            run_id=run.pk,
            checkpoint=artifact or checkpoint,
            version=version,
            rolling=rolling,
            weights=weights,
        )
    )
    return published


def update_and_publish(
    *,
    run: Run,
    cfg: RunConfig,
    trainer: PolicyTrainer,
    batch: batches.Batch,
    kind: str,
    publish: bool,
    rolling: bool = True,
) -> None:
    """Train one update on `batch` under the run's settings `cfg` (a warm-start `kind` is
    behaviour cloning alone), record it (and its version when `publish`) in one transaction,
    and tell the dashboard after commit."""
    trained_version = trainer.state.version
    try:
        metrics = trainer.update(
            batch.samples,
            cfg.curation,
            stop=shutdown_requested.is_set,
            behaviour_cloning=kind == "warm_start",
        )
    except UpdateInterrupted as exc:
        # The worker is stopping (Ctrl-C): nothing of this update is recorded and its groups
        # stay ready; the next trainer resumes from the last published version.
        log.info("run %s: %s for the worker's shutdown; its groups stay ready", run.pk, exc)
        trainer_forget(run_id=run.pk)
        return
    try:
        path = trainer.save_version(trained_version + 1) if publish else None
        artifact = (
            checkpoint_upload(run_id=run.pk, version=trained_version + 1, checkpoint=path)
            if path is not None
            else ""
        )
    except Exception as exc:
        if not is_disk_full(exc, path=trainer.run_dir):
            raise
        # Nothing of this update is recorded (its groups stay ready) and no half-written
        # version is left; the next trainer resumes from the last published version.
        version_tmp_remove(version_dir(trainer.run_dir, trained_version + 1))
        trainer_forget(run_id=run.pk)
        run_pause_for_disk(
            run_id=run.pk,
            what=f"version {trained_version + 1}'s checkpoint under {trainer.run_dir}",
            exc=exc,
        )
        return
    weights = (
        weights_serve(run_id=run.pk, trainer=trainer, version=trained_version + 1)
        if path is not None
        else None
    )
    with transaction.atomic():
        update = batches.batch_commit(
            run=run, batch=batch, metrics=metrics, trained_version=trained_version, kind=kind
        )
        if path is not None:
            policy_version_publish(
                run=run,
                version=trained_version + 1,
                checkpoint=path,
                artifact=artifact,
                rolling=rolling,
                weights=weights,
            )
        publish_on_commit(
            run_id=run.pk, kind="update", data={"number": update.number, "metrics": update.metrics}
        )
    if path is not None:  # committed: the new version's state is what a restart resumes from
        kept = cfg.trainer
        optimizer_states_prune(
            run_id=run.pk, run_dir=trainer.run_dir, keep=kept.optimizer_states_kept
        )
        versions_prune(
            run_id=run.pk,
            run_dir=trainer.run_dir,
            kept=kept.versions_kept,
            every=kept.versions_keep_every,
        )
    export_update(update_id=update.pk)  # committed: TensorBoard gets the same figures


def train_for(*, run_id: int, max_seconds: float, stop: threading.Event | None = None) -> str:
    """The decoupled trainer's time slice: warm start, then an update whenever enough ready
    groups exist (saying on the run what it waits for meanwhile)."""
    last_message = ""

    def body(run: Run, cfg: RunConfig) -> str | None:
        nonlocal last_message
        trainer = get_trainer(run, cfg)
        policy_version_record_reach(run_id=run.pk)
        if trainer.state.version == 0 and trainer.state.updates == 0:
            eval_schedule_next(run_id=run.pk)  # the starting policy's evaluation
        if trainer.state.updates < cfg.trainer.warm_start_bc_updates:
            _warm_start_update(run, cfg, trainer)
            return None
        batch = batches.batch_collect(run=run, current_version=trainer.state.version)
        if batch is not None and not batch.samples and batch.empty_group_ids:
            message = "trainer " + batches.batch_skip(batch=batch)
            log.info("run %s: %s", run.pk, message)
            run_set_message(run_id=run.pk, message=message)
            return None
        if batch is None or not batch.samples:
            # A killed env worker leaves its episode running: end it so the group completes.
            run_orphans_abort(run_id=run.pk, cfg=cfg)
            message = _waiting_message(run, cfg)
            if message != last_message:
                run_set_message(run_id=run.pk, message=message)
                last_message = message
            time.sleep(1.0)
            return None
        mixed = batches.pool_mix(
            batch=batch,
            run=run,
            cfg=cfg,
            current_version=trainer.state.version,
            seed=trainer.state.updates,
        )
        mix_note = f" (of them {mixed} experience-pool demo steps mixed in)" if mixed else ""
        run_set_message(run_id=run.pk, message=f"training on {len(batch.samples)} steps{mix_note}")
        update_and_publish(
            run=run,
            cfg=cfg,
            trainer=trainer,
            batch=batch,
            kind="rl",
            publish=(trainer.state.updates + 1) % cfg.trainer.checkpoint_every == 0,
        )
        last_message = ""
        return None

    return run_loop(run_id=run_id, max_seconds=max_seconds, stop=stop, body=body)


def _warm_start_update(run: Run, cfg: RunConfig, trainer: PolicyTrainer) -> None:
    """One behaviour-cloning update on the experience pool of the run's tasks; the last one
    publishes the warm-started version."""
    batch = batches.pool_batch(
        run=run, cfg=cfg, current_version=trainer.state.version, seed=trainer.state.updates
    )
    if batch is None:
        run_set_message(run_id=run.pk, message="warm start skipped: the experience pool is empty")
        trainer.state.updates = cfg.trainer.warm_start_bc_updates
        return
    run_set_message(
        run_id=run.pk,
        message=f"behaviour-cloning warm start {trainer.state.updates + 1}/"
        f"{cfg.trainer.warm_start_bc_updates} on {len(batch.samples)} demo steps",
    )
    update_and_publish(
        run=run,
        cfg=cfg,
        trainer=trainer,
        batch=batch,
        kind="warm_start",
        publish=trainer.state.updates + 1 >= cfg.trainer.warm_start_bc_updates,
    )


def _through_outages(loop: Callable[..., str], *, run_id: int, stop: threading.Event) -> str:
    """Run the loop for one time slice; an outage of the database or Redis pauses it rather
    than failing the trainer. The weights in memory may be ahead of what was recorded (an
    update whose commit failed), so they are dropped and the loop resumes from the newest
    published checkpoint: no step is trained twice, none is lost."""
    deadline = time.monotonic() + SLICE_SECONDS
    while True:
        try:
            return loop(run_id=run_id, max_seconds=max(1.0, deadline - time.monotonic()), stop=stop)
        except Exception as exc:
            if not is_outage(exc) or stop.is_set() or time.monotonic() > deadline:
                raise
            log.warning(
                "run %s: trainer paused by an outage (%s: %s); it resumes from the "
                "newest published checkpoint",
                run_id,
                type(exc).__name__,
                exc,
            )
            trainer_forget(run_id=run_id)
            db_retry(
                lambda _: Run.objects.filter(pk=run_id).exists(),
                what=f"waiting to resume the trainer of run {run_id}",
            )
            time.sleep(2.0)


def trainer_drive(loop: Callable[..., str], *, run_id: int, mode: str) -> str:
    """Run one time slice of a run's trainer loop and re-enqueue its task for the next.

    One live trainer per run: the slice holds the run's trainer lease (a duplicate task finds
    it held and ends; a killed trainer's lease lapses and the watchdog enqueues it again).
    A loop that raises must not stop silently while the run keeps rolling out: the run says
    what failed, the trainer held in memory (maybe half-updated) is dropped so the retry
    resumes from the last published checkpoint, and the retry comes RETRY_SECONDS later."""
    work = trainer_work(run_id=run_id, mode=mode)
    keeper = work_hold(work, holder=holder_name(f"trainer:{run_id}"))
    if isinstance(keeper, str):
        return f"the trainer of run {run_id} is held by {keeper}"
    try:
        reason = _through_outages(loop, run_id=run_id, stop=keeper.lost)
    except Exception as exc:
        log.exception("run %s: trainer failed", run_id)
        trainer_forget(run_id=run_id)
        if not Run.objects.filter(pk=run_id).exists():
            return "run deleted"
        run_set_message(
            run_id=run_id,
            message=f"trainer failed: {type(exc).__name__}: {exc}. Retrying in "
            f"{RETRY_SECONDS:.0f} s from the last published checkpoint; the train worker's "
            "log has the traceback.",
        )
        work_enqueue(work, countdown=RETRY_SECONDS)
        return f"failed: {type(exc).__name__}: {exc}"
    finally:
        keeper.finish()
    if keeper.lost.is_set():
        # Another worker holds this run's trainer now; this one's weights are not trusted.
        trainer_forget(run_id=run_id)
        return "trainer lease lost to another worker"
    if reason == "time slice over":
        work_enqueue(work)
    return reason
