"""Writes of policy versions: publishing one, which inference workers serve it, and which
ones had their weights pruned."""

from __future__ import annotations

from pathlib import Path

from django.utils import timezone

from core.artifacts import STATE_FILE
from datamanager.models import PolicyVersion, Run


def policy_version_create(
    *, run: Run, version: int, checkpoint: Path, artifact: str = ""
) -> PolicyVersion:
    """A published version of the run's policy (inside the update's transaction), with what
    it costs on disk: its weights, and its optimizer state (`core.artifacts.STATE_FILE`)."""
    files = [p for p in checkpoint.rglob("*") if p.is_file()] if checkpoint.is_dir() else []
    state = sum(p.stat().st_size for p in files if p.name == STATE_FILE)
    return PolicyVersion.objects.create(
        run=run,
        version=version,
        checkpoint=str(checkpoint),
        artifact=artifact,
        weights_bytes=sum(p.stat().st_size for p in files) - state,
        state_bytes=state,
    )


def policy_versions_mark_pruned(*, run_id: int, versions: list[int]) -> None:
    """Record that these versions' weights were deleted (their metrics stay)."""
    PolicyVersion.objects.filter(run_id=run_id, version__in=versions).update(
        pruned_at=timezone.now()
    )


def policy_version_add_reach(*, version_id: int, workers: list[str]) -> None:
    """Add inference workers that now serve this version to its record."""
    latest = PolicyVersion.objects.get(pk=version_id)
    reached = sorted(set(latest.reached_workers) | set(workers))
    if reached != sorted(latest.reached_workers):
        PolicyVersion.objects.filter(pk=version_id).update(reached_workers=reached)
