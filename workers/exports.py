"""A run's scalars in the tools researchers already use: TensorBoard event files in the run's
directory (`DARTBOARD_HOME/checkpoints/run-<id>/tensorboard`, on the trainer's host), one
point per trainer update (its number is the step, its time the wall time); and, when
configured, Weights & Biases (DARTBOARD_WANDB_PROJECT, workers/exports_wandb.py) and MLflow
(DARTBOARD_MLFLOW_TRACKING_URI, workers/exports_mlflow.py) at the same steps.

    tensorboard --logdir ~/.dartboard/checkpoints

The trainer calls `export_update` after each update is committed. An export that fails is
logged with its reason and never fails the update, nor the other exports: the database stays
the record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings

from datamanager.models import TrainUpdate
from datamanager.selectors.scalars import run_scalars
from workers.exports_mlflow import mlflow_close, mlflow_log
from workers.exports_wandb import wandb_close, wandb_log

log = logging.getLogger("dartboard.exports")

_WRITERS: dict[int, Any] = {}  # run id -> SummaryWriter (one per trainer process and run)


def tensorboard_dir(run_id: int) -> Path:
    return Path(settings.CHECKPOINT_ROOT) / f"run-{run_id}" / "tensorboard"


def _writer(run_id: int) -> Any:
    if run_id not in _WRITERS:
        from torch.utils.tensorboard import SummaryWriter  # start-up cost only in the trainer

        _WRITERS[run_id] = SummaryWriter(log_dir=str(tensorboard_dir(run_id)))
    return _WRITERS[run_id]


@dataclass(frozen=True)
class ExportResult:
    """Scalars written per destination: 0 where that export failed (logged), None where it
    is not configured."""

    tensorboard: int
    wandb: int | None = None
    mlflow: int | None = None


def export_update(*, update_id: int) -> ExportResult:
    """Write the run's scalars at this update to TensorBoard and to W&B and MLflow where
    configured. Runs in the trainer process after the update's transaction committed."""
    try:
        update = TrainUpdate.objects.select_related("run").get(pk=update_id)
        scalars = run_scalars(update=update)
    except Exception:
        log.exception(
            "reading update %s's scalars for export failed (the update stands)", update_id
        )
        return ExportResult(tensorboard=0)
    return ExportResult(
        tensorboard=_export("TensorBoard", update, scalars, _tensorboard_log),
        wandb=(
            _export("W&B", update, scalars, wandb_log) if settings.DARTBOARD_WANDB_PROJECT else None
        ),
        mlflow=(
            _export("MLflow", update, scalars, mlflow_log)
            if settings.DARTBOARD_MLFLOW_TRACKING_URI
            else None
        ),
    )


def _export(
    destination: str,
    update: TrainUpdate,
    scalars: dict[str, float],
    write: Callable[[TrainUpdate, dict[str, float]], None],
) -> int:
    try:
        write(update, scalars)
        return len(scalars)
    except Exception:
        log.exception(
            "exporting update %s (run %s, step %s) to %s failed (the update stands)",
            update.pk,
            update.run_id,
            update.number,
            destination,
        )
        return 0


def _tensorboard_log(update: TrainUpdate, scalars: dict[str, float]) -> None:
    writer = _writer(update.run_id)
    walltime = update.created_at.timestamp()
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, global_step=update.number, walltime=walltime)
    writer.flush()


def exports_close(run_id: int) -> None:
    """Flush and close this trainer process's writers for the run (a later export opens them
    again: TensorBoard appends, W&B resumes its run, MLflow finds its run by tag)."""
    writer = _WRITERS.pop(run_id, None)
    if writer is not None:
        writer.close()
    wandb_close(run_id)
    mlflow_close(run_id)


def exports_close_all() -> None:
    """Close every run's writers this process holds."""
    for run_id in list(_WRITERS):
        exports_close(run_id)
