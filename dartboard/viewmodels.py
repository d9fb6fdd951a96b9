"""The run page's web-side view-models: the env wall (slot tiles, paged and filtered, and
who holds each slot now from Redis leases) and the alerts and dead-time notes above it.

Its database reads are `datamanager.selectors`' (`dashboard` for the wall, the host map, the
notes and the alerts); this module turns them into tiles and sentences, and reads the
workers' Redis leases. A Redis outage is said on the page (`live_work_rows`), never raised.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import redis
from django.conf import settings
from django.core.paginator import Paginator
from django.utils import timezone

from datamanager.live_work import LiveWork, redis_client, run_live_work
from datamanager.models import (
    EnvSlot,
    EvalScope,
    EvalStatus,
    PlacementState,
    Run,
    RunStatus,
    SlotStatus,
)
from datamanager.selectors.dashboard import (
    evaluating_version,
    evaluations_under_way,
    hosts_with_placements,
    latest_logprob_gap,
    newest_version,
    placement_part,
    placement_parts,
    run_placement,
    slot_tiles,
    stale_episodes,
    unsolved_tasks,
    wall_slots,
    warm_start_durations,
)
from datamanager.selectors.flow import step_flow, step_flow_windows, training_backlog
from datamanager.selectors.runs import (
    LOST,
    SERVING_STATUSES,
    checkpoint_disk,
    current_slots,
    slot_silence,
)


@dataclass(frozen=True)
class SlotTile:
    """One env slot on the environment wall."""

    id: int
    name: str
    status: str
    last_error: str
    trajectory_id: int | None
    task_name: str
    step: int | None
    image: str
    policy_version: int | None
    env_busy: float | None  # share of the slot's life its env spent in reset/step/evaluate


def _busy_share(slot: EnvSlot) -> float | None:
    if slot.last_heartbeat is None:
        return None
    alive = (slot.last_heartbeat - slot.created_at).total_seconds()
    return min(1.0, slot.env_busy_s / alive) if alive > 0 else None


WALL_STATUSES = (
    *SERVING_STATUSES,
    SlotStatus.RELEASED,
    SlotStatus.QUARANTINED,
    SlotStatus.STOPPED,
    LOST,
)


@dataclass(frozen=True)
class SlotWall:
    """One page of the env wall: its tiles, and what the whole wall holds (per status)."""

    tiles: list[SlotTile]
    counts: dict[str, int]  # every status of the run's slots, `lost` apart from the rest
    total: int  # slots matching the filter
    page: int
    pages: int
    status: str  # the filter ("" for every status)
    query: str  # a substring of the slot's name or its current task's name
    per_page: int

    @property
    def complete(self) -> bool:
        """Every slot of the run is on this page: live events may add new tiles to it."""
        return not self.status and not self.query and self.pages <= 1


# Tiles on a page of the env wall unless the page asks for more (`?per=`, views.py).
WALL_PER_PAGE = 60


def run_slots(
    *,
    run: Run,
    status: str = "",
    query: str = "",
    page: int | str = 1,
    per_page: int = WALL_PER_PAGE,
) -> SlotWall:
    """A page of the run's env slots, with the latest screenshot of each slot's current
    trajectory, filtered by status (`lost` included) and by a substring of the slot's or its
    task's name. Paged, because 1,000 tiles are neither readable nor cheap: the page holds
    `per_page` tiles and counts the rest by status.

    One tile per slot: the row of the worker that served it last (`current_slots`). It shows
    as `lost`, with how long ago, when that worker stopped heart-beating while serving (a
    killed worker cannot say so itself); `released` when its time slice ended and the slot
    waits for the next env worker (behind evaluation shards, say)."""
    lost_after = run.cfg.env.silent_after_s
    rows, counts = wall_slots(run=run, lost_after=lost_after, status=status, query=query)
    paginator = Paginator(rows.values_list("pk", flat=True), per_page)
    current = paginator.get_page(page)
    slots = slot_tiles(pks=list(current.object_list))
    now = timezone.now()
    tiles = []
    for s in slots:
        shown, error = s.status, s.last_error
        silent = slot_silence(s.status, s.last_heartbeat, lost_after=lost_after, now=now)
        if silent is not None:
            shown = LOST
            error = f"no heartbeat for {silent:.0f} s: its worker stopped"
        elif shown == SlotStatus.RELEASED:
            error = "time slice over: waiting for the next env worker (evaluation shards first)"
        tiles.append(
            SlotTile(
                id=s.pk,
                name=s.name,
                status=shown,
                last_error=error,
                trajectory_id=s.current_trajectory_id,
                task_name=s.task_name or "",
                step=s.step_index,
                image=f"/media/{s.step_image}" if s.step_image else "",
                policy_version=s.step_version,
                env_busy=_busy_share(s),
            )
        )
    return SlotWall(
        tiles=tiles,
        counts={k: v for k, v in counts.items() if v},
        total=paginator.count,
        page=current.number,
        pages=paginator.num_pages,
        status=status,
        query=query,
        per_page=per_page,
    )


@dataclass(frozen=True)
class LiveWorkRow:
    """A running run's slot task or trainer, and whether a live worker holds it."""

    label: str
    state: str  # "live", "queued" or "missing"
    text: str


def live_work_rows(*, run: Run, fold_after: int = 20) -> list[LiveWorkRow]:
    """Who holds each of a running run's slots and its trainer now (Redis leases,
    workers/leases.py); empty unless the run is running. Past `fold_after` live slots they
    are counted in one row, and past `fold_after` rows of work without a live worker the
    rest are counted too, so a 1,000-slot run's page lists what needs a look and stays small.

    With Redis down the page still renders: one row says the live state is unavailable and
    why. Only Redis's connection and timeout errors are caught; anything else is a bug and
    raises."""
    if run.status != RunStatus.RUNNING:
        return []
    works = run_live_work(run_id=run.pk, cfg=run.cfg)
    try:
        answers = _lease_answers(works)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        return [
            LiveWorkRow("workers", "missing", f"Redis unreachable, live state unavailable: {exc}")
        ]
    behind = _evaluating(run)
    rows = [_work_row(work, holder, pending, behind) for work, (holder, pending) in answers]
    return _folded(rows, fold_after)


def _evaluating(run: Run) -> str:
    """What a queued slot task waits behind on the env workers: the run's evaluation under
    way ("the evaluation of v48"), or "" when none is."""
    version = evaluating_version(run=run)
    if version is None:
        return ""
    return "the evaluation of " + ("the starting policy" if not version else f"v{version}")


def _lease_answers(works: list[LiveWork]) -> list[tuple[LiveWork, tuple[bytes | None, int]]]:
    """Each work's lease holder and pending marker, read in one pipeline (1,000 slots were
    2,000 round trips per page view). Raises Redis's errors."""
    client = redis_client()
    try:
        pipe = client.pipeline(transaction=False)
        for work in works:
            pipe.get(work.lease_key)
            pipe.exists(work.pending_key)
        answers = pipe.execute()
    finally:
        client.close()
    return list(zip(works, zip(answers[::2], answers[1::2], strict=True), strict=True))


def _work_row(work: LiveWork, holder: bytes | None, pending: int, behind: str) -> LiveWorkRow:
    if holder is not None:
        return LiveWorkRow(work.label, "live", f"held by {holder.decode()}")
    if pending:
        waits = f" behind {behind}" if behind and work.queue == "env" else ""
        return LiveWorkRow(work.label, "queued", f"queued on {work.queue}{waits}")
    return LiveWorkRow(
        work.label,
        "missing",
        "no live worker; the watchdog enqueues it again after "
        f"{settings.DARTBOARD_WATCHDOG_GRACE_S:.0f} s",
    )


def _folded(rows: list[LiveWorkRow], fold_after: int) -> list[LiveWorkRow]:
    """Live slots past `fold_after` counted in one row first; work without a live worker past
    `fold_after` rows counted in one row last."""
    live_slots = sum(r.state == "live" and r.label.startswith("slot ") for r in rows)
    if live_slots > fold_after:
        rows = [r for r in rows if r.state != "live" or not r.label.startswith("slot ")]
        rows.insert(0, LiveWorkRow(f"{live_slots} slots", "live", "held by live workers"))
    rest = [r for r in rows if r.state != "live"]
    if len(rest) > fold_after:  # e.g. every slot of a run whose workers are gone
        shown = set(map(id, rest[:fold_after]))
        rows = [r for r in rows if r.state == "live" or id(r) in shown]
        rows.append(
            LiveWorkRow(f"{len(rest) - fold_after} more", "missing", "queued or without a worker")
        )
    return rows


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


UNSOLVED_MIN_ATTEMPTS = 8  # rollouts before the run page says a task has never succeeded


@dataclass(frozen=True)
class HostRow:
    """One host on the runs page: what it has, what its runs take, which runs."""

    name: str
    last_seen: datetime
    gpus: str
    cpu: str
    env_kinds: str
    runs: list[tuple[int, str]]


def host_rows() -> list[HostRow]:
    """Every host an agent reported: GPUs with the memory its runs take of each, CPU
    inference slots in use, env kinds, and the runs placed on it."""
    rows = []
    for host, placed in hosts_with_placements():
        taken: dict[str, float] = {}
        cpu_used = 0
        for p in placed:
            part = placement_part(p.plan, host.name)
            for index, gib in (part.get("gpu_gib") or {}).items():
                taken[index] = taken.get(index, 0.0) + gib
            cpu_used += sum(1 for g in part.get("inference_gpus") or [] if g is None)
        gpus = ", ".join(
            f"GPU {g['index']} {g['name']}: {taken.get(str(g['index']), 0.0):.0f} of "
            f"{g['memory_gib']:.0f} GiB taken"
            for g in host.gpus
        )
        if host.gpus and not host.cuda_torch:
            gpus += " (unusable: this torch is the CPU build; make torch-cuda)"
        rows.append(
            HostRow(
                name=host.name,
                last_seen=host.last_seen,
                gpus=gpus or "none",
                cpu=f"{host.cpu_cores} cores, {host.memory_gib:.0f} GiB; CPU inference "
                f"{cpu_used} of {host.cpu_inference_slots}",
                env_kinds=", ".join(host.env_kinds),
                runs=[(p.run_id, p.run.name) for p in placed],
            )
        )
    return rows


def placement_note(*, run: Run) -> str:
    """The run page's line on its own processes (a host agent's placement): where they run,
    on which devices, or why the run waits; "" for a run on the shared rollout service."""
    placement = run_placement(run=run)
    if placement is None:
        return ""
    plan = placement.plan or {}
    if placement.state == PlacementState.QUEUED:
        return f"Processes: {placement.reason or 'queued'}"
    if placement.state == PlacementState.ENDED:
        return f"Processes: stopped{': ' + placement.reason if placement.reason else ''}"
    parts = placement_parts(plan)
    if len(parts) > 1:
        router = f"; router {placement.router_url}" if placement.router_url else ""
        return (
            f"Processes: {placement.state} over {len(parts)} hosts: "
            + "; ".join(_part_note(part) for part in parts)
            + router
        )
    where = placement.host.name if placement.host else "?"
    inference = plan.get("inference_gpus") or []
    devices = (
        f"trainer on GPU {', '.join(map(str, plan.get('trainer_gpus') or []))}; inference on "
        f"GPU {', '.join(str(g) for g in inference)}"
        if plan.get("device") == "cuda"
        else f"CPU: trainer and {len(inference)} inference worker{'s' if len(inference) != 1 else ''}"
    )
    router = f"; router {placement.router_url}" if placement.router_url else ""
    return f"Processes: {placement.state} on {where} ({devices}{router})"


def _part_note(part: dict) -> str:
    """What one host runs of a run spread over several: "gpu-2 (10.0.0.2): trainer ranks
    8-11 on GPU 0-3, 2 inference workers on GPU 4, 5, the router"."""
    what = []
    ranks = part.get("trainer_ranks") or []
    if ranks:
        gpus = part.get("trainer_gpus") or []
        on = f" on GPU {', '.join(map(str, gpus))}" if gpus else ""
        what.append(
            f"trainer rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}{on}"
        )
    inference = part.get("inference_gpus") or []
    if inference:
        on = "" if None in inference else f" on GPU {', '.join(map(str, inference))}"
        what.append(f"{len(inference)} inference worker{'s' if len(inference) != 1 else ''}{on}")
    if part.get("router") and part.get("worker_ports"):
        what.append("the router")
    if part.get("env_workers"):
        n = part["env_workers"]
        what.append(f"{n} env worker{'s' if n != 1 else ''}")
    return f"{part.get('host', '?')} ({part.get('address', '?')}): {', '.join(what) or 'nothing'}"


def unsolved_tasks_note(*, run: Run, min_attempts: int = UNSOLVED_MIN_ATTEMPTS) -> str:
    """The run page's line for the tasks still at 0% after `min_attempts` rollouts, with
    their rollout counts (RL cannot lift a task it never sees solved), or ""."""
    stuck = unsolved_tasks(run=run, min_attempts=min_attempts)
    if not stuck:
        return ""
    tasks = ", ".join(f"{name} (0 of {n})" for name, n in stuck)
    return (
        f"No success yet on {len(stuck)} task{'s' if len(stuck) != 1 else ''} after "
        f"{min_attempts} or more rollouts: {tasks}. Without a success RL has nothing to "
        "reinforce there; the task board has each task's rollouts and failure labels."
    )


def dead_time_notes(*, run: Run) -> list[str]:
    """What a running run is busy with where no chart moves, and roughly how long it will
    take: the behaviour-cloning warm start (from its updates so far) and each scheduled
    evaluation under way (from its episodes so far)."""
    if run.status != RunStatus.RUNNING:
        return []
    notes = []
    cfg = run.cfg
    planned = cfg.trainer.warm_start_bc_updates
    warm = warm_start_durations(run=run)
    if planned and len(warm) < planned:
        left = planned - len(warm)
        if warm:
            per = sum(warm) / len(warm)
            eta = f"about {_minutes(per * left)} left ({per:.0f} s an update so far)"
        else:
            eta = "the first update's time gives the estimate"
        notes.append(
            f"Warm start: behaviour cloning on the experience pool, {len(warm)} of {planned} "
            f"updates done, {eta}; RL and the first RL version follow it."
        )
    now = timezone.now()
    for job in evaluations_under_way(run=run):
        what = EvalScope(job.scope).label if job.scope else "its tasks"
        if job.done:
            per = (now - job.created_at).total_seconds() / job.done
            eta = f"about {_minutes(per * (job.total - job.done))} left"
        else:
            eta = "waiting for a free env slot" if job.status == EvalStatus.QUEUED else "starting"
        notes.append(
            f"Evaluating v{job.policy_version} greedily on {what}: {job.done} of {job.total} "
            f"episodes, {eta} (it shares the env slots with training)."
        )
    return notes


def run_alerts(*, run: Run) -> list[str]:
    """Health signals past their thresholds, for the run page (each says what it measured,
    the threshold, and what it may mean)."""
    alerts = []
    trainer = run.cfg.trainer
    stale = _stale_serving(run=run, behind=trainer.stale_serving_alert)
    if stale:
        alerts.append(stale)
    threshold = trainer.logprob_gap_alert
    latest = latest_logprob_gap(run=run)
    if threshold > 0 and latest is not None:
        number, version, metrics = latest
        gap = float(metrics.get("logprob_gap_mean", 0.0))
        if gap > threshold:
            alerts.append(
                f"Log-prob gap: update {number} measured {gap:.3f} nats per token (p99 "
                f"{float(metrics.get('logprob_gap_p99', 0.0)):.3f}) between the trainer and "
                f"the rollout on steps sampled from version {version}, over the alert "
                f"threshold {threshold:g}. Both sides should hold the same weights there: an "
                "inference worker may be serving other weights than the version it reports."
            )
    return alerts


def _stale_serving(*, run: Run, behind: int) -> str:
    """The alert for an episode under way whose newest step was sampled `behind` or more
    versions before the newest published version, else "". Only running episodes are read
    (one per slot at most), through their newest step."""
    newest = newest_version(run=run)
    if not behind or newest is None:
        return ""
    running = stale_episodes(run=run, at_most=newest - behind)
    worst = running.first()
    if worst is None:
        return ""
    slot = worst.env_slot.name if worst.env_slot else "an unknown slot"
    return (
        f"Stale weights served: trajectory {worst.pk} on {slot} sampled its step of "
        f"{timezone.localtime(worst.step_at):%H:%M:%S} from version {worst.step_version}, "
        f"{newest - worst.step_version} versions behind the newest (v{newest}); "
        f"{running.count()} episode(s) under way are {behind} or more behind. An inference "
        "worker the weight sync did not reach? See the router's workers on the health line."
    )


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB" if n < 2**30 else f"{n / 2**30:,.2f} GB"


def checkpoint_note(*, run: Run) -> str:
    """The run page's line on its versions' disk: what is kept, what one costs; "" before the
    first version."""
    cfg = run.cfg.trainer
    disk = checkpoint_disk(run=run, states_kept=cfg.optimizer_states_kept)
    if disk is None:
        return ""
    rule = (
        "every version's weights kept"
        if cfg.versions_kept == 0
        else f"weights kept: the newest {cfg.versions_kept}"
        + (f", every {cfg.versions_keep_every}th" if cfg.versions_keep_every else "")
        + ", the best by greedy success and any under evaluation"
    )
    return (
        f"Checkpoints: {disk.kept} of {disk.versions} versions keep their weights "
        f"({_mb(disk.weights_bytes)}) and the newest {min(cfg.optimizer_states_kept, disk.versions)} "
        f"their optimizer state ({_mb(disk.state_bytes)}); a version costs "
        f"{_mb(disk.version_weights_bytes)} of weights and {_mb(disk.version_state_bytes)} of "
        f"state ({rule})."
    )


def _pct(share: float | None) -> str:
    return "—" if share is None else f"{share:.0%}"


def flow_note(*, run: Run) -> str:
    """The run page's line on where its collected steps went (datamanager.selectors.flow);
    "" before the first."""
    flow = step_flow(run=run)
    if not flow.collected:
        return ""
    return (
        f"Collected steps: {flow.collected:,}; of the {flow.decided:,} settled, "
        f"{flow.trained:,} trained ({_pct(flow.share('trained'))}), {flow.entropy:,} left out "
        f"by the entropy selection ({_pct(flow.share('entropy'))}), {flow.stale:,} as stale "
        f"({_pct(flow.share('stale'))}), {flow.lost:,} with their episode (error, abort, "
        f"rejection: {_pct(flow.share('lost'))}); {flow.waiting:,} waiting. "
        f"{flow.trained_per_min:.1f} trained actions a minute."
    )


def held_note(*, run: Run) -> str:
    """While the run's trainer is behind: how many slots hold their training claims and why
    (curation.backpressure); "" otherwise."""
    if run.status != RunStatus.RUNNING:
        return ""
    backlog = training_backlog(run_id=run.pk, cfg=run.cfg)
    if not backlog.limit:  # backpressure off: no slot holds, nothing to count
        return ""
    held = current_slots(run=run).filter(status=SlotStatus.HELD).count()
    if not backlog.held and not held:
        return ""
    slots = f"{held} slot{'s' if held != 1 else ''} held" if held else "slots about to hold"
    return f"{slots}: {backlog.reason()}."


def flow_windows(*, run: Run) -> list[dict[str, object]]:
    """The run page's table of the last hour of collected steps, ten minutes a row."""
    return [
        {
            "start": f.start,
            "end": f.end,
            "collected": f.collected,
            "trained": _pct(f.share("trained")),
            "entropy": _pct(f.share("entropy")),
            "stale": _pct(f.share("stale")),
            "lost": _pct(f.share("lost")),
            "waiting": f.waiting,
            "per_min": f"{f.trained_per_min:.1f}",
        }
        for f in step_flow_windows(run=run)
        if f.collected
    ]
