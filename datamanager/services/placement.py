"""Writes to the host and placement tables: what each host has, and where each run's own
processes run (the host agent, `hostagent/agent.py`, is their one writer besides a start)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from datamanager.models import Host, PlacementState, Run, RunPlacement, RunStatus


def host_report(*, name: str, **facts: Any) -> Host:
    """Create or update a host with what its agent found (gpus, cpu_cores, memory_gib,
    cuda_torch, cpu_inference_slots, env_kinds, address) and mark it seen now."""
    host, _ = Host.objects.update_or_create(
        name=name, defaults={**facts, "last_seen": timezone.now()}
    )
    return host


def placement_queue(*, run_id: int) -> RunPlacement:
    """A started run waits for a host agent: its placement (new, or the last one's) is queued
    again, at the back of the queue."""
    now = timezone.now()
    RunPlacement.hosts.through.objects.filter(runplacement__run_id=run_id).delete()
    placement, _ = RunPlacement.objects.update_or_create(
        run_id=run_id,
        defaults={
            "state": PlacementState.QUEUED,
            "host": None,
            "plan": {},
            "router_url": "",
            "reason": "waiting for a host agent",
            "queued_at": now,
        },
    )
    return placement


@transaction.atomic
def placement_claim(
    *,
    placement_id: int,
    host: Host,
    plan: dict[str, Any],
    router_url: str,
    hosts: list[Host] | None = None,
) -> bool:
    """A host agent takes a queued placement: STARTING with `plan`, a part on each of
    `hosts` (by default `host` alone), `host` answering for it. False when it is no longer queued (another agent took
    it, or the run stopped)."""
    placement = RunPlacement.objects.select_for_update().get(pk=placement_id)
    if placement.state != PlacementState.QUEUED:
        return False
    placement.host = host
    placement.plan = plan
    placement.router_url = router_url
    placement.state = PlacementState.STARTING
    placement.reason = ""
    placement.save()
    placement.hosts.set(hosts or [host])
    return True


def placement_move(
    *, placement_id: int, plan: dict[str, Any], router_url: str, reason: str
) -> None:
    """A placed run's agent moved its serving processes (`plan`'s new ports): STARTING
    again until its router answers, saying why."""
    RunPlacement.objects.filter(pk=placement_id).update(
        plan=plan,
        router_url=router_url,
        state=PlacementState.STARTING,
        reason=reason,
        updated_at=timezone.now(),
    )


@transaction.atomic
def placement_requeue_lost(*, seen_before: datetime) -> list[tuple[int, str]]:
    """The placements of runs still going on hosts whose agent last reported before
    `seen_before` (the host is gone, and its processes with it): queued again, at the front,
    for any host with room, saying which host was lost and since when (on the run's page).
    Returns (run id, lost host) for each. The lost host's agent, if it comes back, stops
    what it held of them (`HostAgent._stop_ended`)."""
    lost_hosts = Host.objects.filter(last_seen__lt=seen_before)
    lost = RunPlacement.objects.select_for_update().filter(
        pk__in=RunPlacement.objects.filter(
            state__in=(PlacementState.STARTING, PlacementState.UP),
            hosts__in=lost_hosts,
            run__status__in=(RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSED),
        ).values("pk")
    )
    moved = []
    for placement in lost:
        gone = placement.hosts.filter(last_seen__lt=seen_before).order_by("name").first()
        assert gone is not None
        name, seen = gone.name, gone.last_seen
        placement.reason = (
            f"its host {name} stopped reporting at {seen:%Y-%m-%d %H:%M:%S} UTC; placed again "
            "on the next hosts with room"
        )
        placement.state, placement.host, placement.plan = PlacementState.QUEUED, None, {}
        placement.router_url = ""
        placement.save()
        placement.hosts.clear()
        Run.objects.filter(pk=placement.run_id).update(status_message=placement.reason)
        moved.append((placement.run_id, name))
    return moved


def placement_set(*, placement_id: int, state: str, reason: str = "") -> None:
    RunPlacement.objects.filter(pk=placement_id).update(
        state=state, reason=reason, updated_at=timezone.now()
    )


def placement_wait(*, placement_id: int, reason: str) -> None:
    """Say why a queued placement waits (shown on the run's page)."""
    RunPlacement.objects.filter(pk=placement_id, state=PlacementState.QUEUED).update(
        reason=reason, updated_at=timezone.now()
    )
