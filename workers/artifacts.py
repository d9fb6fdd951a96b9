"""Published versions through the artifact store (core/artifacts.py, settings.DARTBOARD_ARTIFACTS).

The trainer uploads every version it publishes (`checkpoint_upload`, before the update's
transaction: a 7B checkpoint may take minutes); the version's reference goes on its
PolicyVersion row and is what the router syncs, so each inference host fetches and verifies
it itself. A trainer started on a host that lacks the run's newest version fetches it first
(`checkpoint_restore`), optimizer state included, and resumes from it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from pathlib import Path

from django.conf import settings

from core.artifacts import (
    MANIFEST,
    STATE_FILE,
    ArtifactError,
    ArtifactRef,
    FileStore,
    S3Store,
    StoreUnreachable,
    fetch,
    open_store,
    upload_dir,
)
from datamanager.models import EvalJob, EvalStatus, PolicyVersion, Run
from datamanager.selectors.charts import version_best
from datamanager.services.versions import policy_versions_mark_pruned
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
    log.info(
        "run %s: version %s fetched from %s into %s", run.pk, latest.version, store.url, target
    )
    return target


PRUNE_WINDOW = 8


def optimizer_states_prune(*, run_id: int, run_dir: Path, keep: int) -> list[int]:
    """Delete the optimizer state of every published version of the run but the newest
    `keep`, on this host's disk and in the store; their weights stay. Call after the newest
    version's publish committed: until then the previous state is what a restart resumes
    from. Returns the versions pruned now.

    Inference hosts fetch versions without their state (rollout.checkpoints), so a pruned
    version still serves; only a trainer resuming from it would miss it, and a trainer
    resumes from the newest. Each publish pushes one version out of the kept ones; the
    `PRUNE_WINDOW` versions past them are tried again, so a prune that failed (the store
    down) is made good by a later one without each publish touching every old version."""
    versions = list(
        PolicyVersion.objects.filter(run_id=run_id)
        .order_by("-version")
        .values_list("version", "artifact")[: keep + PRUNE_WINDOW]
    )
    store = open_store(settings.DARTBOARD_ARTIFACTS) if any(a for _, a in versions[keep:]) else None
    pruned = []
    for version, artifact in versions[keep:]:
        local = version_dir(run_dir, version) / STATE_FILE
        had_local = local.exists()
        local.unlink(missing_ok=True)
        if artifact and store is not None:
            name = f"{ArtifactRef.parse(artifact).key}/{STATE_FILE}"
            db_retry(
                functools.partial(_delete, store, name),
                what=f"pruning version {version}'s optimizer state in {store.url}",
            )
        if had_local or artifact:
            pruned.append(version)
    if pruned:
        log.info(
            "run %s: optimizer state of versions %s pruned (kept the newest %s)",
            run_id,
            pruned,
            keep,
        )
    return pruned


def _delete(store: FileStore | S3Store, name: str, _attempt: object) -> None:
    store.delete(name)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def versions_prune(*, run_id: int, run_dir: Path, kept: int, every: int) -> list[int]:
    """Delete the weights of the run's published versions past the newest `kept`, except
    every `every`-th (0: none), the best by greedy success and any an evaluation still has
    to run (queued or running), on this host's disk, in its artifact cache and in the store;
    their rows and metrics stay (`PolicyVersion.pruned_at`). `kept` 0 keeps them all. Call
    after the newest version's publish committed. Returns the versions pruned now.

    Another inference host's cache of a pruned version stays until that host's own cache is
    cleared: it only ever serves the newest."""
    if kept <= 0:
        return []
    run = Run.objects.get(pk=run_id)
    rows = list(
        PolicyVersion.objects.filter(run_id=run_id, pruned_at__isnull=True)
        .order_by("-version")
        .values_list("version", "artifact")
    )
    protected = {version_best(run=run)}
    protected |= set(
        EvalJob.objects.filter(
            run_id=run_id, status__in=(EvalStatus.QUEUED, EvalStatus.RUNNING)
        ).values_list("policy_version", flat=True)
    )
    doomed = [
        (v, a) for v, a in rows[kept:] if v not in protected and not (every and v % every == 0)
    ]
    if not doomed:
        return []
    store = open_store(settings.DARTBOARD_ARTIFACTS) if any(a for _, a in doomed) else None
    pruned = []
    for version, artifact in doomed:
        shutil.rmtree(version_dir(run_dir, version), ignore_errors=True)
        if artifact and store is not None:
            ref = ArtifactRef.parse(artifact)
            for path in settings.DARTBOARD_ARTIFACT_CACHE.glob(f"{ref.digest}*"):
                shutil.rmtree(path, ignore_errors=True)
            db_retry(
                functools.partial(_delete_version, store, ref),
                what=f"pruning version {version}'s weights in {store.url}",
            )
        pruned.append(version)
    policy_versions_mark_pruned(run_id=run_id, versions=pruned)
    log.info(
        "run %s: weights of versions %s pruned (kept the newest %s, every %s-th, the best "
        "and those under evaluation)",
        run_id,
        pruned,
        kept,
        every or "no",
    )
    return pruned


def _delete_version(store: FileStore | S3Store, ref: ArtifactRef, _attempt: object) -> None:
    """Every file the version's manifest lists, then the manifest (a version whose manifest
    is already gone was pruned before)."""
    try:
        manifest = json.loads(store.get_bytes(f"{ref.key}/{MANIFEST}"))
    except StoreUnreachable:
        raise  # db_retry waits for the store
    except ArtifactError:
        return
    for rel in manifest["files"]:
        store.delete(f"{ref.key}/{rel}")
    store.delete(f"{ref.key}/{MANIFEST}")
