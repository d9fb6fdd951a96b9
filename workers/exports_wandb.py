"""A run's scalars in Weights & Biases: one W&B run per Dartboard run (id `dartboard-run-<id>`,
named `dartboard-run-<id> <name>`, its resolved config as the W&B config), one point per
trainer update at the update's number. On when DARTBOARD_WANDB_PROJECT is set; W&B reads its
own variables (WANDB_MODE=offline writes under WANDB_DIR without a network; `wandb sync`
uploads later; WANDB_API_KEY, WANDB_ENTITY, WANDB_BASE_URL for a server).

Called by workers/exports.py in the trainer process, after the update is committed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from django.conf import settings

from datamanager.models import Run, TrainUpdate
from datamanager.selectors.scalars import run_params

_RUNS: dict[int, Any] = {}  # Dartboard run id -> wandb Run (one per trainer process and run)


def wandb_run_id(run_id: int) -> str:
    return f"dartboard-run-{run_id}"


def _wandb_run(run: Run) -> Any:
    if run.pk not in _RUNS:
        import wandb  # start-up cost (a second) only in a trainer that exports to W&B

        _RUNS[run.pk] = wandb.init(
            project=settings.DARTBOARD_WANDB_PROJECT,
            # The same id after a trainer restart continues the W&B run instead of a new one.
            id=wandb_run_id(run.pk),
            resume="allow",
            name=f"{wandb_run_id(run.pk)} {run.name}",
            config=run_params(run=run),
            dir=os.environ.get("WANDB_DIR") or str(_run_dir(run.pk)),
            settings=wandb.Settings(
                # A trainer may train several runs; each keeps its own W&B run.
                reinit="create_new",
                # The worker's own logs stay where they are: no capture of its stdout.
                console="off",
                silent=True,
            ),
        )
    return _RUNS[run.pk]


def _run_dir(run_id: int) -> Path:
    path = Path(settings.CHECKPOINT_ROOT) / f"run-{run_id}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def wandb_log(update: TrainUpdate, scalars: dict[str, float]) -> None:
    _wandb_run(update.run).log(scalars, step=update.number)


def wandb_close(run_id: int) -> None:
    wandb_run = _RUNS.pop(run_id, None)
    if wandb_run is not None:
        wandb_run.finish()
