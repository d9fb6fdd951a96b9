"""Reads for the failure-annotation queue: the next rollout to label, the counts per task and
per host, and the labels as JSON Lines for export."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, F, QuerySet
from django.db.models.functions import Mod

from datamanager.models import FailureLabel, Trajectory, TrajectorySource, TrajectoryStatus

QUEUE_SCOPES = ("failed", "sampled")
ENDED_BADLY = (TrajectoryStatus.FAILED, TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED)
ENDED = (*ENDED_BADLY, TrajectoryStatus.SUCCEEDED)


def _queue(*, run_id: int, scope: str) -> QuerySet[Trajectory]:
    """Unlabelled online rollouts of the run: every failure (`failed`: failed, error or
    aborted), or every ended rollout in a fixed shuffled order (`sampled`: successes too, so
    a reward that says success wrongly is found as well)."""
    if scope not in QUEUE_SCOPES:
        raise ValueError(f"unknown queue {scope!r}; queues: {', '.join(QUEUE_SCOPES)}")
    qs = Trajectory.objects.filter(
        run_id=run_id,
        source=TrajectorySource.ONLINE,
        failure_label__isnull=True,
        finished_at__isnull=False,
    )
    if scope == "failed":
        return qs.filter(status__in=ENDED_BADLY).order_by("-finished_at", "-pk")
    # A multiplicative hash of the id: stable across page loads, spread over tasks and time.
    return (
        qs.filter(status__in=ENDED)
        .annotate(shuffle=Mod(F("pk") * 7919, 1009))
        .order_by("shuffle", "pk")
    )


@dataclass(frozen=True)
class QueueHead:
    trajectory: Trajectory | None
    remaining: int  # unlabelled rollouts in the queue, this one included
    labelled: int  # labels on the run so far


def label_queue_head(*, run_id: int, scope: str, skip: tuple[int, ...] = ()) -> QueueHead:
    """The next rollout to label (`skip`: ids the person passed over in this session)."""
    queue = _queue(run_id=run_id, scope=scope)
    head = queue.exclude(pk__in=skip).select_related("task", "env_slot").first()
    return QueueHead(
        trajectory=head,
        remaining=queue.count(),
        labelled=FailureLabel.objects.filter(run_id=run_id).count(),
    )


def label_counts_by_task(*, run_id: int) -> dict[int, dict[str, int]]:
    """{task id: {label: count}} of the run's labels."""
    counts: dict[int, dict[str, int]] = {}
    rows = (
        FailureLabel.objects.filter(run_id=run_id)
        .values_list("trajectory__task_id", "label")
        .annotate(n=Count("pk"))
        .order_by()
    )
    for task_id, label, n in rows:
        counts.setdefault(task_id, {})[label] = n
    return counts


def label_counts_by_host(*, run_id: int, label: str) -> dict[str, int]:
    """{host: count} of the run's `label` labels on rollouts served by that host's slots."""
    rows = (
        FailureLabel.objects.filter(run_id=run_id, label=label)
        .values_list("trajectory__env_slot__host")
        .annotate(n=Count("pk"))
        .order_by()
    )
    return {host or "unknown": n for host, n in rows}


def labels_export(*, run_id: int | None) -> Iterator[dict[str, Any]]:
    """Every label (of one run, or all), oldest first, as one JSON-ready dict each."""
    qs = FailureLabel.objects.select_related(
        "trajectory__task", "trajectory__env_slot", "user"
    ).order_by("created_at", "pk")
    if run_id is not None:
        qs = qs.filter(run_id=run_id)
    for lab in qs.iterator(chunk_size=500):
        traj = lab.trajectory
        yield {
            "trajectory": traj.pk,
            "run": lab.run_id,
            "task": traj.task.name,
            "label": lab.label,
            "comment": lab.comment,
            "user": lab.user.username if lab.user else None,
            "at": lab.created_at.isoformat(),
            "status": traj.status,
            "reward": traj.reward,
            "end_reason": traj.details.get("end_reason"),
            "error": traj.error,
            "host": traj.env_slot.host if traj.env_slot else None,
            "seed": traj.seed,
            "policy_versions": traj.policy_versions,
        }
