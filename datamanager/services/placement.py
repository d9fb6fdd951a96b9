"""Writes to the host and placement tables: what each host has, and where each run's own
processes run (the host agent, `hostagent/agent.py`, is their one writer besides a start)."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from datamanager.models import Host, PlacementState, RunPlacement


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
    *, placement_id: int, host: Host, plan: dict[str, Any], router_url: str
) -> bool:
    """A host agent takes a queued placement: STARTING on `host` with `plan`. False when it
    is no longer queued (another agent took it, or the run stopped)."""
    placement = RunPlacement.objects.select_for_update().get(pk=placement_id)
    if placement.state != PlacementState.QUEUED:
        return False
    placement.host = host
    placement.plan = plan
    placement.router_url = router_url
    placement.state = PlacementState.STARTING
    placement.reason = ""
    placement.save()
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


def placement_set(*, placement_id: int, state: str, reason: str = "") -> None:
    RunPlacement.objects.filter(pk=placement_id).update(
        state=state, reason=reason, updated_at=timezone.now()
    )


def placement_wait(*, placement_id: int, reason: str) -> None:
    """Say why a queued placement waits (shown on the run's page)."""
    RunPlacement.objects.filter(pk=placement_id, state=PlacementState.QUEUED).update(
        reason=reason, updated_at=timezone.now()
    )
