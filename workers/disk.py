"""A full disk is a state of the run, not a corruption: a write that finds no space left (a
version's checkpoint, a step's screenshot, the database) pauses the run with what could not
be written and where; the watchdog resumes it once the disks hold enough again.

Nothing half-written becomes a version: the trainer writes a version into `vNNNNN.tmp` and
renames it only when whole (training.trainer.save_version); a failed write's `.tmp` is
deleted here, the update is not recorded (its groups stay ready) and the trainer resumes
from the last published version.
"""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

from django.conf import settings
from django.db import transaction

from datamanager.models import PolicyVersion, Run, RunStatus
from datamanager.services.run_workers import RunNotStartable, run_apply
from datamanager.services.runs import (
    InvalidTransition,
    run_action_record,
    run_control,
    run_set_message,
)

log = logging.getLogger("dartboard.disk")

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
MIN_FREE = 200 * 2**20  # resume with at least this free, and room for two versions


NEARLY_FULL = 4 * 2**20


def is_disk_full(exc: BaseException | None, *, path: Path | None = None) -> bool:
    """The exception (or one it came from) is a write that found no space left: OSError
    ENOSPC/EDQUOT, SQLite's "database or disk is full", or, for a write under `path`, any
    failure while that filesystem is all but full (torch.save's writer says only
    "iostream error" when it runs out of space)."""
    if exc is not None and path is not None and _free_mb(path) * 2**20 < NEARLY_FULL:
        return True
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return True
        if "database or disk is full" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def disk_paths() -> list[Path]:
    """Where a run writes on this host: checkpoints, screenshots (media) and the home."""
    return [
        Path(settings.CHECKPOINT_ROOT),
        Path(settings.MEDIA_ROOT),
        Path(settings.DARTBOARD_HOME),
    ]


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _free_mb(path: Path) -> float:
    return shutil.disk_usage(_existing(path)).free / 2**20


def home_disk() -> tuple[int, int]:
    """(free, total) bytes of the disk this host's DARTBOARD_HOME is on (the host map)."""
    usage = shutil.disk_usage(_existing(Path(settings.DARTBOARD_HOME)))
    return usage.free, usage.total


def run_pause_for_disk(*, run_id: int, what: str, exc: BaseException) -> None:
    """Pause the run because writing `what` found no space; the page and the log say so.
    Where even that write fails (the database's own disk is full), the log says it."""
    free = ", ".join(f"{p}: {_free_mb(p):,.0f} MB free" for p in disk_paths())
    message = (
        f"paused: no space left on device writing {what} ({exc}); {free}. It resumes "
        f"by itself once there is room (at least {MIN_FREE // 2**20} MB and two versions)"
    )
    log.error("run %s: %s", run_id, message)
    try:
        with transaction.atomic():
            run = Run.objects.select_for_update().get(pk=run_id)
            if run.status == RunStatus.RUNNING:
                run_control(run_id=run_id, action="pause")
            Run.objects.filter(pk=run_id).update(paused_for_disk=True)
            run_set_message(run_id=run_id, message=message)
        run_action_record(run_id=run_id, action="pause", user=None, outcome=message)
    except Exception as err:  # the database's disk may be the full one
        log.error("run %s: could not record the pause (%s: %s)", run_id, type(err).__name__, err)


def runs_resume_after_disk() -> list[int]:
    """Resume every run paused for a full disk whose disks now hold enough (the watchdog
    calls this each pass); returns their ids."""
    resumed = []
    for run in Run.objects.filter(paused_for_disk=True):
        newest = PolicyVersion.objects.filter(run=run).order_by("-version").first()
        need = max(MIN_FREE, 2 * (newest.weights_bytes + newest.state_bytes) if newest else 0)
        short = [p for p in disk_paths() if _free_mb(p) * 2**20 < need]
        if short:
            continue
        Run.objects.filter(pk=run.pk).update(paused_for_disk=False)
        if run.status != RunStatus.PAUSED:
            continue  # stopped or resumed by hand meanwhile
        try:
            run_apply(run_id=run.pk, action="resume")
        except (InvalidTransition, RunNotStartable) as exc:
            log.warning("run %s: space is back but it did not resume: %s", run.pk, exc)
            continue
        run_set_message(run_id=run.pk, message=f"resumed: {need / 2**20:,.0f} MB free again")
        log.info("run %s: resumed, the disks have room again", run.pk)
        resumed.append(run.pk)
    return resumed


def version_tmp_remove(path: Path) -> None:
    """Delete a version directory a failed write left half-written."""
    shutil.rmtree(path.with_name(path.name + ".tmp"), ignore_errors=True)
