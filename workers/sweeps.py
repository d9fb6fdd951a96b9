"""Starting a sweep's members as earlier ones end.

`sweep_advance` starts the next members (in order) while fewer than the sweep's `parallel`
are queued, running or paused, each as its owner's Start button would (`run_apply`). The API
calls it when it makes a sweep; Celery beat calls `sweeps_advance` every
DARTBOARD_WATCHDOG_PERIOD_S (task `workers.tasks.sweeps_advance`), so the next member starts
within that time of the previous one ending, however it ended (finished, stopped, failed).
With `parallel` 1 the members run one after another whatever the hosts could hold; a larger
`parallel` lets the host agents' queue place them as room frees.
"""

from __future__ import annotations

import logging

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from datamanager.models import RunStatus, Sweep, SweepMember
from datamanager.roles import CAN_ADMINISTER
from datamanager.services.runs import (
    InvalidTransition,
    NotYourRun,
    run_set_message,
)
from workers.runs import RunNotStartable, run_apply

log = logging.getLogger("dartboard.sweeps")

ACTIVE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSED)


def sweep_advance(*, sweep_id: int) -> list[int]:
    """Start the sweep's next members while fewer than `parallel` are active; returns the
    run ids it started. A member that cannot start says why on its run and is passed over."""
    started: list[int] = []
    with transaction.atomic():
        sweep = Sweep.objects.select_for_update().get(pk=sweep_id)
        if sweep.stopped_at is not None:
            return started
        members = SweepMember.objects.filter(sweep=sweep).select_related("run")
        active = members.filter(run__status__in=ACTIVE).count()
        waiting = members.filter(launched_at__isnull=True, run__status=RunStatus.CREATED)
        for member in waiting.order_by("index"):
            if active >= sweep.parallel:
                break
            member.launched_at = timezone.now()
            member.save(update_fields=["launched_at"])
            try:
                run_apply(run_id=member.run_id, action="start", user=sweep.owner)
            except (InvalidTransition, RunNotStartable, NotYourRun) as exc:
                run_set_message(
                    run_id=member.run_id, message=f"the sweep could not start it: {exc}"
                )
                log.warning("sweep %s: run %s not started: %s", sweep.pk, member.run_id, exc)
                continue
            active += 1
            started.append(member.run_id)
    return started


def sweeps_advance() -> list[int]:
    """`sweep_advance` for every sweep with members still to start."""
    open_sweeps = Sweep.objects.filter(
        stopped_at__isnull=True, members__launched_at__isnull=True
    ).distinct()
    started: list[int] = []
    for sweep_id in open_sweeps.values_list("pk", flat=True):
        started += sweep_advance(sweep_id=sweep_id)
    return started


def sweep_stop(*, sweep_id: int, user: User | None) -> Sweep:
    """Stop a sweep: members not yet started never start, and the active ones stop (each
    recorded as its Stop button's would be). Only its owner or an admin may (NotYourRun)."""
    with transaction.atomic():
        sweep = (
            Sweep.objects.select_for_update(of=("self",)).select_related("owner").get(pk=sweep_id)
        )
        owner = sweep.owner
        if user is not None and owner not in (None, user) and not user.has_perm(CAN_ADMINISTER):
            raise NotYourRun(
                f"sweep #{sweep.pk} belongs to {owner.get_username()}: only its owner or an "
                "admin may stop it"
            )
        if sweep.stopped_at is None:
            sweep.stopped_at = timezone.now()
            sweep.save(update_fields=["stopped_at"])
    active = SweepMember.objects.filter(sweep=sweep, run__status__in=ACTIVE)
    for run_id in active.values_list("run_id", flat=True):
        run_apply(run_id=run_id, action="stop", user=user)
    return sweep
