"""Published versions through the artifact store (core/artifacts.py, settings.DARTBOARD_ARTIFACTS).

The trainer uploads every version it publishes (`checkpoint_upload`, before the update's
transaction: a 7B checkpoint may take minutes); the version's reference goes on its
PolicyVersion row and is what the router syncs, so each inference host fetches and verifies
it itself. A trainer started on a host that lacks the run's newest version fetches it first
(`checkpoint_restore`), optimizer state included, and resumes from it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from django.conf import settings

from core.artifacts import STATE_FILE, ArtifactRef, fetch, open_store, upload_dir
from datamanager.models import PolicyVersion, Run
from training.trainer import version_dir
from workers.dbutil import db_retry

log = logging.getLogger("dartboard.artifacts")


def checkpoint_upload(*, run_id: int, version: int, checkpoint: Path) -> str:
    """Store a version's directory; returns its reference (artifact:runs/R/vNNNNN@sha256)."""
    store = open_store(settings.DARTBOARD_ARTIFACTS)
    ref = db_retry(  # the store restarting mid-upload: the upload starts again
        lambda _: upload_dir(store, f"runs/{run_id}/v{version:05d}", checkpoint),
        what=f"uploading version {version} of run {run_id} to {store.url}",
    )
    log.info("run %s: version %s stored as %s in %s", run_id, version, ref, store.url)
    return str(ref)


def checkpoint_restore(*, run: Run, run_dir: Path) -> Path | None:
    """Make the run's newest stored version present under `run_dir` (fetched and verified,
    then linked in), unless it already is. Returns its directory, or None with nothing
    stored."""
    latest = PolicyVersion.objects.filter(run=run).exclude(artifact="").order_by("-version").first()
    if latest is None:
        return None
    target = version_dir(run_dir, latest.version)
    if (target / STATE_FILE).exists():
        return target
    store = open_store(settings.DARTBOARD_ARTIFACTS)
    local = fetch(store, ArtifactRef.parse(latest.artifact), settings.DARTBOARD_ARTIFACT_CACHE)
    tmp = target.with_name(target.name + ".fetch")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(local, tmp, copy_function=_link_or_copy)
    (tmp / "MANIFEST.json").unlink(missing_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    log.info("run %s: version %s fetched from %s into %s", run.pk, latest.version, store.url,
             target)  # fmt: skip
    return target


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
