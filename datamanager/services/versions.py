"""Writes of policy versions: publishing one, and which inference workers serve it."""

from __future__ import annotations

from pathlib import Path

from datamanager.models import PolicyVersion, Run


def policy_version_create(
    *, run: Run, version: int, checkpoint: Path, artifact: str = ""
) -> PolicyVersion:
    """A published version of the run's policy (inside the update's transaction)."""
    return PolicyVersion.objects.create(
        run=run, version=version, checkpoint=str(checkpoint), artifact=artifact
    )


def policy_version_add_reach(*, version_id: int, workers: list[str]) -> None:
    """Add inference workers that now serve this version to its record."""
    latest = PolicyVersion.objects.get(pk=version_id)
    reached = sorted(set(latest.reached_workers) | set(workers))
    if reached != sorted(latest.reached_workers):
        PolicyVersion.objects.filter(pk=version_id).update(reached_workers=reached)
