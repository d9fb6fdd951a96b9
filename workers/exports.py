"""A run's scalars in the tools researchers already use: TensorBoard event files in the run's
directory (`DARTBOARD_HOME/checkpoints/run-<id>/tensorboard`, on the trainer's host), one
point per trainer update (its number is the step, its time the wall time).

    tensorboard --logdir ~/.dartboard/checkpoints

The trainer calls `export_update` after each update is committed. An export that fails is
logged and never fails the update: the database stays the record.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from django.conf import settings

from datamanager.models import TrainUpdate
from datamanager.selectors.scalars import run_scalars

log = logging.getLogger("dartboard.exports")

_WRITERS: dict[int, Any] = {}  # run id -> SummaryWriter (one per trainer process and run)


def tensorboard_dir(run_id: int) -> Path:
    return Path(settings.CHECKPOINT_ROOT) / f"run-{run_id}" / "tensorboard"


def _writer(run_id: int) -> Any:
    if run_id not in _WRITERS:
        from torch.utils.tensorboard import SummaryWriter  # start-up cost only in the trainer

        _WRITERS[run_id] = SummaryWriter(log_dir=str(tensorboard_dir(run_id)))
    return _WRITERS[run_id]


def export_update(*, update_id: int) -> int:
    """Write the run's scalars at this update; returns how many were written (0 on failure,
    which is logged)."""
    try:
        update = TrainUpdate.objects.get(pk=update_id)
        scalars = run_scalars(update=update)
        writer = _writer(update.run_id)
        walltime = update.created_at.timestamp()
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, global_step=update.number, walltime=walltime)
        writer.flush()
        return len(scalars)
    except Exception:
        log.exception("exporting update %s to TensorBoard failed (the update stands)", update_id)
        return 0


def exports_close(run_id: int) -> None:
    writer = _WRITERS.pop(run_id, None)
    if writer is not None:
        writer.close()
