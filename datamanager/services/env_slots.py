"""Services for env slots: register, heartbeat, status changes, quarantine."""

from __future__ import annotations

from collections.abc import Mapping

from django.db.models import Case, F, FloatField, Value, When
from django.utils import timezone

from datamanager.events import publish_on_commit
from datamanager.models import EnvSlot, SlotStatus, Trajectory, slot_key
from datamanager.services.episodes import trajectories_abort_cut


def env_slot_register(
    *, name: str, host: str, backend: str, run_id: int | None, sandbox_note: str = ""
) -> EnvSlot:
    """Create or revive the slot row of this worker process (status starting).
    sandbox_note: why its sandboxes run without resource limits (empty: enforced).

    The caller holds the slot's lease, so no other worker runs an episode on it: an episode
    still running there was cut by an earlier worker's death, and ends `aborted` here. The
    watchdog ends such episodes too, but only while the slot's heartbeat is stale, and a
    worker started again within the watchdog's grace revives the row first."""
    slot, _ = EnvSlot.objects.update_or_create(
        name=name,
        defaults={
            "key": slot_key(name),
            "host": host,
            "backend": backend,
            "run_id": run_id,
            "sandbox_note": sandbox_note,
            "status": SlotStatus.STARTING,
            "last_heartbeat": timezone.now(),
            "current_trajectory": None,
        },
    )
    trajectories_abort_cut(
        Trajectory.objects.filter(env_slot=slot),
        error=f"the env worker stopped mid-episode; slot {name} was taken up again on {host}",
    )
    return slot


def env_slot_heartbeat(
    *, slot_id: int, env_busy_s: float | None = None, disk: tuple[int, int] | None = None
) -> None:
    """The slot is alive; `env_busy_s` is the environment busy time served on this slot
    so far (envmanager.busy), stored for utilisation figures; `disk`, (free, total) bytes
    of its worker's home disk, for the host map."""
    fields: dict = {"last_heartbeat": timezone.now()}
    if env_busy_s is not None:
        fields["env_busy_s"] = env_busy_s
    if disk is not None:
        fields["disk_free_bytes"], fields["disk_total_bytes"] = disk
    EnvSlot.objects.filter(pk=slot_id).update(**fields)


def env_slots_heartbeat(*, busy_s: Mapping[int, float]) -> int:
    """Many slots are alive, in one UPDATE: `busy_s` maps each slot id to its environment
    busy seconds so far. For a process that serves many slots (bench/scale.py runs 250 a
    process): one statement per period instead of one per slot, and one connection.
    Returns how many rows were updated."""
    if not busy_s:
        return 0
    busy = Case(
        *(When(pk=pk, then=Value(float(s))) for pk, s in busy_s.items()),
        default=F("env_busy_s"),
        output_field=FloatField(),
    )
    return EnvSlot.objects.filter(pk__in=list(busy_s)).update(
        last_heartbeat=timezone.now(), env_busy_s=busy
    )


def env_slot_set(
    *,
    slot_id: int,
    status: str,
    trajectory_id: int | None = None,
    error: str | None = None,
) -> None:
    """Change a slot's status (and current trajectory); an error is kept as last_error."""
    fields: dict = {
        "status": status,
        "current_trajectory_id": trajectory_id,
        "last_heartbeat": timezone.now(),
    }
    if error is not None:
        fields["last_error"] = error
    EnvSlot.objects.filter(pk=slot_id).update(**fields)
    slot = EnvSlot.objects.get(pk=slot_id)
    if slot.run_id:
        publish_on_commit(
            run_id=slot.run_id,
            kind="slot",
            data={
                "slot": slot_id,
                "name": slot.name,
                "status": status,
                "trajectory": trajectory_id,
                "error": slot.last_error,
            },
        )


def env_slot_failure(*, slot_id: int, error: str, quarantine_after: int) -> bool:
    """Count a failure; quarantine the slot after `quarantine_after` in a row. True if so."""
    EnvSlot.objects.filter(pk=slot_id).update(
        consecutive_failures=F("consecutive_failures") + 1, last_error=error
    )
    slot = EnvSlot.objects.get(pk=slot_id)
    quarantined = slot.consecutive_failures >= quarantine_after
    env_slot_set(
        slot_id=slot_id,
        status=SlotStatus.QUARANTINED if quarantined else SlotStatus.RECOVERING,
        error=error,
    )
    return quarantined


def env_slot_success(*, slot_id: int) -> None:
    EnvSlot.objects.filter(pk=slot_id).update(consecutive_failures=0)
