"""Sweeps: one config run over a grid of settings and seeds, each member its own run.

`sweep_create` checks every member's settings as the run form does (all problems at once)
and makes the runs, not started. `sweep_advance` starts the next members (in order) while
fewer than the sweep's `parallel` are queued, running or paused, each as its owner's Start
button would (`run_apply`). The API calls it when it makes a sweep; Celery beat calls
`sweeps_advance` every DARTBOARD_WATCHDOG_PERIOD_S (task `workers.tasks.sweeps_advance`), so
the next member starts within that time of the previous one ending, however it ended
(finished, stopped, failed). With `parallel` 1 the members run one after another whatever
the hosts could hold; a larger `parallel` lets the host agents' queue place them as room
frees.
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from datamanager.config import ConfigError, ConfigInvalid, config_override
from datamanager.models import RunStatus, Sweep, SweepMember
from datamanager.roles import CAN_ADMINISTER
from datamanager.services.run_workers import RunNotStartable, run_apply
from datamanager.services.runs import (
    InvalidTransition,
    NotYourRun,
    run_config_validate,
    run_create,
    run_set_message,
)

log = logging.getLogger("dartboard.sweeps")

ACTIVE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSED)

MAX_MEMBERS = 64
MAX_PARALLEL = 16


def sweep_points(*, grid: dict[str, list[Any]], seeds: int, base_seed: int) -> list[dict[str, Any]]:
    """Each member's overrides, in order: every combination of the grid's values (its keys
    in the order given) for each of `seeds` seeds (base_seed, base_seed + 1, ...); the
    seed is left out when the grid sets it itself."""
    keys = list(grid)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]
    if "seed" in grid:
        return combos
    return [{**combo, "seed": base_seed + i} for combo in combos for i in range(seeds)]


def point_label(overrides: dict[str, Any]) -> str:
    """`trainer.lr=1e-05 seed=1`: a member's overrides as its name shows them."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in overrides.items())


def _grid_problems(grid: Any, seeds: Any, parallel: Any) -> list[ConfigError]:
    problems: list[ConfigError] = []
    if not isinstance(grid, dict):
        return [ConfigError("grid", "must be an object of setting -> list of values")]
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            problems.append(ConfigError(f"grid.{key}", "give a non-empty list of values"))
        elif len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
            problems.append(ConfigError(f"grid.{key}", "a value appears twice"))
    if isinstance(seeds, bool) or not isinstance(seeds, int) or not 1 <= seeds <= MAX_MEMBERS:
        problems.append(ConfigError("seeds", f"must be an integer from 1 to {MAX_MEMBERS}"))
    elif "seed" in grid and seeds != 1:
        problems.append(ConfigError("seeds", "the grid sets seed itself: leave seeds at 1"))
    if (
        isinstance(parallel, bool)
        or not isinstance(parallel, int)
        or not 1 <= parallel <= MAX_PARALLEL
    ):
        problems.append(ConfigError("parallel", f"must be an integer from 1 to {MAX_PARALLEL}"))
    return problems


@transaction.atomic
def sweep_create(
    *,
    name: str,
    config: dict[str, Any],
    grid: dict[str, list[Any]],
    seeds: int = 1,
    parallel: int = 1,
    owner: User | None,
) -> Sweep:
    """A sweep and its member runs (created, not started), each checked as a run form
    checks it. Raises ConfigInvalid with every problem: the base config's, then each
    member's own (its message names the member's values), each problem once."""
    problems = _grid_problems(grid, seeds, parallel)
    if problems:
        raise ConfigInvalid(problems)
    base = run_config_validate(data=config, user=owner)
    points = sweep_points(grid=grid, seeds=seeds, base_seed=base.seed)
    if len(points) > MAX_MEMBERS:
        raise ConfigInvalid(
            [ConfigError("grid", f"{len(points)} runs; a sweep makes at most {MAX_MEMBERS}")]
        )
    configs = []
    seen: set[tuple[str, str]] = set()
    for point in points:
        data = config
        for key, value in point.items():
            data = config_override(data, key, value)
        try:
            configs.append(run_config_validate(data=data, user=owner))
        except ConfigInvalid as exc:
            for p in exc.problems:
                if (p.path, p.message) not in seen:
                    seen.add((p.path, p.message))
                    problems.append(ConfigError(p.path, f"{p.message} (with {point_label(point)})"))
    if problems:
        raise ConfigInvalid(problems)
    sweep = Sweep.objects.create(
        name=name, owner=owner, config=config, grid=grid, seeds=seeds, parallel=parallel
    )
    for index, (point, cfg) in enumerate(zip(points, configs, strict=True)):
        run = run_create(name=f"{name} [{point_label(point)}]"[:200], config=cfg, owner=owner)
        SweepMember.objects.create(sweep=sweep, run=run, index=index, overrides=point)
    return sweep


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
