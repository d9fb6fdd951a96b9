"""Reads behind the dashboard's env wall, host map, notes and alerts (`dartboard.viewmodels`
turns them into tiles and sentences): slots with their current step, hosts with their
placements, evaluations under way, warm-start updates, the latest log-prob gap, episodes
served stale weights. Plain reads, safe from any process.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Count, F, Max, OuterRef, Q, QuerySet, Subquery

from datamanager.models import (
    EnvSlot,
    EvalJob,
    EvalStatus,
    Host,
    PlacementState,
    PolicyVersion,
    Run,
    RunPlacement,
    Step,
    TaskStat,
    TrainUpdate,
    Trajectory,
    TrajectoryStatus,
)
from datamanager.selectors.runs import LOST, current_slots, lost_slots_q


def wall_slots(
    *, run: Run, lost_after: float, status: str = "", query: str = ""
) -> tuple[QuerySet[EnvSlot], dict[str, int]]:
    """The run's current slots filtered by status (`lost`: silent past `lost_after` while
    serving) and by a substring of the slot's or its task's name, with every slot's count
    by status (lost apart)."""
    lost = lost_slots_q(lost_after=lost_after)
    rows = current_slots(run=run)
    counts: dict[str, int] = dict(
        rows.exclude(lost).values_list("status").annotate(n=Count("pk")).order_by("status")
    )
    counts[LOST] = rows.filter(lost).count()
    if status == LOST:
        rows = rows.filter(lost)
    elif status:
        rows = rows.filter(status=status).exclude(lost)
    if query:
        rows = rows.filter(
            Q(name__icontains=query) | Q(current_trajectory__task__name__icontains=query)
        )
    return rows.order_by("name"), counts


def slot_tiles(*, pks: list[int]) -> QuerySet[Any]:
    """These slots by name, each with its current trajectory's newest step (index,
    screenshot, version) and task name (annotated: rows are EnvSlots with those too)."""
    last_step = Step.objects.filter(trajectory=OuterRef("current_trajectory")).order_by("-index")
    return (
        EnvSlot.objects.filter(pk__in=pks)
        .annotate(
            step_index=Subquery(last_step.values("index")[:1]),
            step_image=Subquery(last_step.values("screenshot")[:1]),
            step_version=Subquery(last_step.values("policy_version")[:1]),
            task_name=F("current_trajectory__task__name"),
        )
        .order_by("name")
    )


def evaluating_version(*, run: Run) -> int | None:
    """The policy version of the run's evaluation under way (the oldest), or None."""
    return (
        EvalJob.objects.filter(run=run, status=EvalStatus.RUNNING)
        .order_by("pk")
        .values_list("policy_version", flat=True)
        .first()
    )


def evaluations_under_way(*, run: Run) -> list[EvalJob]:
    return list(
        EvalJob.objects.filter(
            run=run, status__in=(EvalStatus.QUEUED, EvalStatus.RUNNING)
        ).order_by("pk")
    )


def hosts_with_placements() -> list[tuple[Host, list[RunPlacement]]]:
    """Every host an agent reported, with the placements starting or up with a part on it."""
    return [
        (
            host,
            list(
                RunPlacement.objects.filter(
                    hosts=host, state__in=(PlacementState.STARTING, PlacementState.UP)
                ).select_related("run")
            ),
        )
        for host in Host.objects.all()
    ]


def placement_parts(plan: dict) -> list[dict]:
    """A stored placement's parts, one per host (`hostagent.cluster.ClusterPlacement`): a
    run on one host is stored as that host's part alone."""
    if "parts" in plan:
        return list(plan["parts"])
    return [plan] if plan else []


def placement_part(plan: dict, host: str) -> dict:
    """`host`'s part of a stored placement ({} when it has none)."""
    return next((p for p in placement_parts(plan) if p.get("host") == host), {})


def run_placement(*, run: Run) -> RunPlacement | None:
    return RunPlacement.objects.filter(run=run).select_related("host").first()


def unsolved_tasks(*, run: Run, min_attempts: int) -> list[tuple[str, int]]:
    """(task name, rollouts) of the run's tasks still without a success after
    `min_attempts` rollouts, by name (retired tasks left out)."""
    return list(
        TaskStat.objects.filter(run=run, successes=0, attempts__gte=min_attempts, retired=False)
        .order_by("task__name")
        .values_list("task__name", "attempts")
    )


def warm_start_durations(*, run: Run) -> list[float]:
    """The seconds each behaviour-cloning warm-start update took so far."""
    return [
        float(d or 0)
        for d in TrainUpdate.objects.filter(run=run, metrics__kind="warm_start").values_list(
            "metrics__duration_s", flat=True
        )
    ]


def latest_logprob_gap(*, run: Run) -> tuple[int, int, dict] | None:
    """(update number, policy version, metrics) of the newest update that measured a
    trainer-vs-rollout log-prob gap, or None."""
    return (
        TrainUpdate.objects.filter(run=run, metrics__logprob_gap_tokens__gt=0)
        .order_by("-number")
        .values_list("number", "policy_version", "metrics")
        .first()
    )


def newest_version(*, run: Run) -> int | None:
    return PolicyVersion.objects.filter(run=run).aggregate(v=Max("version"))["v"]


def stale_episodes(*, run: Run, at_most: int) -> QuerySet[Any]:
    """The run's episodes under way whose newest step was sampled from version `at_most` or
    older, oldest first, with that step's version and time and the slot. Only running
    episodes are read (one per slot at most), through their newest step."""
    last_step = Step.objects.filter(trajectory=OuterRef("pk")).order_by("-index")
    return (
        Trajectory.objects.filter(run=run, status=TrajectoryStatus.RUNNING)
        .annotate(
            step_version=Subquery(last_step.values("policy_version")[:1]),
            step_at=Subquery(last_step.values("created_at")[:1]),
        )
        .filter(step_version__isnull=False, step_version__lte=at_most)
        .select_related("env_slot")
        .order_by("step_version", "pk")
    )


def hosts_listing() -> QuerySet[Host]:
    return Host.objects.all()
