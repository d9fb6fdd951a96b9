"""Services of the episode lifecycle: claim a task, finish a trajectory (its steps are stored
by `datamanager.services.steps`).

Called from env slots (Celery env workers). Each function is one short transaction. The
curation rules live in `datamanager.curation`; this module applies them:
claim -> rollout-wise sampling; finish -> success rate, dynamic budget and step cap,
experience-pool fill of an all-failed group, group readiness for the trainer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import Exists, F, OuterRef, QuerySet
from django.utils import timezone

from core.protocol import TaskSpec
from datamanager import curation
from datamanager.config import CurationConfig
from datamanager.events import publish_on_commit
from datamanager.models import (
    SCORED_STATUSES,
    GroupStatus,
    Purpose,
    Run,
    RunStatus,
    Step,
    Task,
    TaskGroup,
    TaskStat,
    TaskStatHistory,
    Trajectory,
    TrajectorySource,
    TrajectoryStatus,
)
from datamanager.selectors.pool import pool_members
from datamanager.selectors.tasks import task_list
from datamanager.services.steps import storable


class NoTasks(Exception):
    """The run's task selection matches no task; the message says which selection."""


@dataclass(frozen=True)
class Claim:
    trajectory_id: int
    task_id: int
    # What the environment is given: the claimed task at the group's seed (shared by the
    # group, curation.group_seed).
    task: TaskSpec
    step_cap: int
    decode_seed: int  # the policy's sampling: one per rollout


def default_step_cap(task: Task, cfg: CurationConfig) -> int:
    """A task may declare its own step budget (`env_config.max_steps`); else the run's."""
    return int(task.env_config.get("max_steps", cfg.default_step_cap))


@transaction.atomic
def taskstats_ensure(*, run: Run) -> int:
    """Create the run's TaskStat rows (once) for the selected tasks. Returns their count."""
    cfg = run.cfg
    tasks = task_list(selection=cfg.tasks)
    if not tasks:
        raise NoTasks(
            f"run {run.pk}: no task matches split={cfg.tasks.split!r}, tags={cfg.tasks.tags}, "
            f"names={cfg.tasks.names}, backends={cfg.tasks.env_kinds}; import tasks first"
        )
    existing = set(TaskStat.objects.filter(run=run).values_list("task_id", flat=True))
    TaskStat.objects.bulk_create(
        [
            TaskStat(
                run=run,
                task=t,
                rollout_budget=cfg.curation.n_max,
                step_cap=default_step_cap(t, cfg.curation),
                outstanding=0,
                group_index=0,
            )
            for t in tasks
            if t.pk not in existing
        ]
    )
    return len(tasks)


def _open_next_groups(run: Run, stats: list[TaskStat]) -> None:
    """Open a new group for every live task (called when no task has claims left)."""
    for stat in stats:
        if stat.retired:
            continue
        budget = stat.pinned_budget or stat.rollout_budget
        stat.group_index += 1
        stat.outstanding = budget
        stat.save(update_fields=["group_index", "outstanding", "updated_at"])
        TaskGroup.objects.create(
            run=run, task_id=stat.task_id, index=stat.group_index, budget=budget
        )


def _claim_budget(
    run: Run, env_kinds: tuple[str, ...], *, begun_only: bool = False
) -> TaskStat | None:
    """Take one claim of a task's open group: the candidates in `pick_task`'s order, each
    row locked with SKIP LOCKED, so concurrent claimers pass each other instead of queueing
    on one row. None: no task has a claim left, or every one that has is being claimed.
    `begun_only`: only groups that already have a claim (see `task_claim`).

    Each try is a savepoint, rolled back when it takes nothing. PostgreSQL keeps the lock
    of a row that the statement locked and then left out on its recheck (its last claim was
    taken, and committed, while the statement ran): held on, that lock would deadlock the
    claim, which next waits for the run row, against the claim opening the next round, which
    holds the run row and writes every task row (tests/datamanager/test_episode_locks.py;
    bench/scale.py runs thousands of slots against it)."""
    rows = TaskStat.objects.filter(run=run, task__env_kind__in=env_kinds, outstanding__gt=0)
    if begun_only:
        begun = TaskGroup.objects.filter(
            run=run, task_id=OuterRef("task_id"), index=OuterRef("group_index"), claimed__gt=0
        )
        rows = rows.filter(Exists(begun))
    left = {
        pk: curation.Candidate(task_id, outstanding, 0.0 if retired else boost)
        for pk, task_id, outstanding, boost, retired in rows.values_list(
            "pk", "task_id", "outstanding", "boost", "retired"
        )
    }
    by_task = {c.task_id: pk for pk, c in left.items()}
    while (task_id := curation.pick_task(list(left.values()))) is not None:
        pk = by_task[task_id]
        tried = transaction.savepoint()
        locked = (
            TaskStat.objects.select_for_update(of=("self",), no_key=True, skip_locked=True)
            .select_related("task")
            .filter(pk=pk, outstanding__gt=0)
            .first()
        )
        if locked is not None:
            transaction.savepoint_commit(tried)
            TaskStat.objects.filter(pk=pk).update(outstanding=F("outstanding") - 1)
            return locked
        transaction.savepoint_rollback(tried)
        del left[pk]
    return None


@transaction.atomic
def task_claim(
    *, run_id: int, slot_id: int | None, env_kinds: tuple[str, ...], begun_only: bool = False
) -> Claim | None:
    """Rollout-wise sampling: the next task for a free slot, with its trajectory started.

    `begun_only`: claim only from a group that already has a claim, never open one: a slot
    held by backpressure still completes the groups under way, so a group's rollouts come
    from versions close together (its advantage compares them with each other).

    Returns None when the run is not running, or has nothing to claim right now. Runs in one
    transaction. A claim locks only the task row it takes (`_claim_budget`: SKIP LOCKED on
    PostgreSQL; on SQLite the IMMEDIATE transaction mode serializes writers). The run row is
    locked only to open the next round of groups, once no task has a claim left: were every
    claim to lock it, a thousand slots' claims would queue on it for seconds (bench/scale.py).

    The row locks here and in `trajectory_finish` are FOR NO KEY UPDATE: a plain FOR UPDATE
    also blocks the foreign-key checks of rows that point at the locked one (a finish's
    TaskStatHistory row points at the run), so a claim holding the run and waiting for a
    TaskStat row would deadlock against a finish holding that TaskStat row and waiting to
    insert its history row (bench/scale.py, with 100 slots and more).
    """
    run = Run.objects.get(pk=run_id)
    if run.status != RunStatus.RUNNING:
        return None
    stat = _claim_budget(run, env_kinds, begun_only=begun_only)
    if stat is None and begun_only:
        return None
    if stat is None:
        run = Run.objects.select_for_update(of=("self",), no_key=True).get(pk=run_id)
        stats = list(TaskStat.objects.filter(run=run, task__env_kind__in=env_kinds))
        if run.status != RunStatus.RUNNING or not stats:
            return None
        if not any(s.outstanding > 0 and not s.retired for s in stats):
            _open_next_groups(run, stats)  # no other claimer got here first
        stat = _claim_budget(run, env_kinds)
        if stat is None:
            return None  # every task retired, or the claims left are being taken
    group = TaskGroup.objects.get(run=run, task_id=stat.task_id, index=stat.group_index)
    TaskGroup.objects.filter(pk=group.pk).update(claimed=F("claimed") + 1)
    cfg = run.cfg
    seed = curation.group_seed(
        run_seed=cfg.seed,
        group_pk=group.pk,
        group_index=group.index,
        instances=cfg.tasks.instances,
        heldout_seed=cfg.evaluation.heldout_seed,
    )
    traj = Trajectory.objects.create(
        run=run,
        task=stat.task,
        env_slot_id=slot_id,
        group=group,
        instruction=stat.task.instruction,
        step_cap=stat.step_cap,
        seed=seed,
    )
    # One per rollout, from the trajectory's id: counting the run's trajectories (as this
    # did) costs a scan that grows with the run, under the run's lock.
    decode_seed = cfg.seed * 1_000_003 + traj.pk
    return Claim(
        trajectory_id=traj.pk,
        task_id=stat.task_id,
        task=stat.task.spec(seed),
        step_cap=stat.step_cap,
        decode_seed=decode_seed,
    )


def trajectory_set_instruction(*, trajectory_id: int, instruction: str) -> None:
    """The environment's own instruction (MiniWoB's utterance differs per episode)."""
    Trajectory.objects.filter(pk=trajectory_id).update(instruction=storable(instruction))


@transaction.atomic
def trajectory_finish(
    *,
    trajectory_id: int,
    status: str,
    reward: float | None,
    details: dict[str, Any] | None = None,
    error: str = "",
    env_ms: float = 0.0,
    model_ms: float = 0.0,
) -> Trajectory:
    """End a trajectory and apply curation to its task (online training rollouts only).

    status: succeeded / failed (policy outcome), error (environment or inference failure:
    recorded with `error`, never counted as a policy failure), aborted (run stopped).
    """
    if status not in TrajectoryStatus.values or status == TrajectoryStatus.RUNNING:
        raise ValueError(f"cannot finish a trajectory as {status!r}")
    traj = (
        Trajectory.objects.select_for_update(of=("self",), no_key=True)
        .select_related("run", "task")
        .get(pk=trajectory_id)
    )
    if traj.status != TrajectoryStatus.RUNNING:
        return traj  # already finished (e.g. a retried task): never count twice
    traj.status = status
    traj.reward = reward
    traj.details = storable(details or {})
    traj.error = storable(error)
    traj.finished_at = timezone.now()
    traj.env_ms = env_ms
    traj.model_ms = model_ms
    fields = ["status", "reward", "details", "error", "finished_at", "env_ms", "model_ms"]
    if status in (TrajectoryStatus.ABORTED, TrajectoryStatus.ERROR):
        # A step is its row, then the trajectory's length (steps_store): a worker killed, or
        # a database lost, between the two leaves the last stored step outside the length.
        # An episode cut short is closed with the steps it stored.
        traj.length = Step.objects.filter(trajectory_id=traj.pk).count()
        fields.append("length")
    traj.save(update_fields=fields)
    # The run's curation settings, parsed once for the rules below (a group's run is its
    # members' run).
    cfg = traj.run.cfg.curation if traj.run is not None else None
    if cfg is not None and traj.purpose == Purpose.TRAIN and status in SCORED_STATUSES:
        _update_stat(traj, cfg)
    if cfg is not None and traj.group_id:
        if status == TrajectoryStatus.ERROR:
            _replace_member(traj, cfg)
        _maybe_ready(traj.group_id, cfg)
    if traj.run_id:
        publish_on_commit(
            run_id=traj.run_id,
            kind="trajectory",
            data={
                "trajectory": traj.pk,
                "task": traj.task_id,
                "status": status,
                "reward": reward,
                "length": traj.length,
                "slot": traj.env_slot_id,
            },
        )
    return traj


def _update_stat(traj: Trajectory, cfg: CurationConfig) -> None:
    run = traj.run
    assert run is not None  # the caller checks traj.run
    stat = TaskStat.objects.select_for_update(of=("self",), no_key=True).get(
        run_id=run.pk, task_id=traj.task_id
    )
    success = traj.status == TrajectoryStatus.SUCCEEDED
    stat.attempts += 1
    stat.successes += success
    recent = (
        Trajectory.objects.filter(
            run_id=run.pk,
            task_id=traj.task_id,
            purpose=Purpose.TRAIN,
            source=TrajectorySource.ONLINE,
            status__in=SCORED_STATUSES,
        )
        .order_by("-finished_at", "-pk")
        .values_list("status", flat=True)[: cfg.success_window]
    )
    rate = curation.rolling_success_rate(
        [s == TrajectoryStatus.SUCCEEDED for s in reversed(recent)], cfg.success_window
    )
    stat.success_rate = rate or 0.0
    if success:
        stat.last_success_at = traj.finished_at
        stat.longest_success = max(stat.longest_success or 0, traj.length)
    stat.rollout_budget = curation.rollout_budget(
        success_rate=rate,
        n_max=cfg.n_max,
        n_min=cfg.n_min,
        threshold=cfg.budget_threshold,
        dynamic=cfg.dynamic_budget,
    )
    stat.step_cap = curation.step_cap(
        longest_success=stat.longest_success,
        default_cap=default_step_cap(traj.task, cfg),
        margin=cfg.step_cap_margin,
        dynamic=cfg.dynamic_step_cap,
    )
    stat.save()


def _replace_member(traj: Trajectory, cfg: CurationConfig) -> None:
    """A member ended in an environment error: while its group is still its task's open one
    and has retries left (`curation.error_retries`), the group gets one more claim, a new
    rollout on a fresh environment (the slot recreates its environment after an error).
    Locks the task row before the group's, as a claim does."""
    assert traj.run_id is not None and traj.group_id is not None  # a group member's
    allowed = cfg.error_retries
    stat = TaskStat.objects.select_for_update(of=("self",), no_key=True).get(
        run_id=traj.run_id, task_id=traj.task_id
    )
    group = TaskGroup.objects.select_for_update(of=("self",), no_key=True).get(pk=traj.group_id)
    if group.status != GroupStatus.OPEN or group.retries >= allowed:
        return
    if stat.group_index != group.index:
        return  # the next round opened: nothing claims this group again
    TaskGroup.objects.filter(pk=group.pk).update(budget=F("budget") + 1, retries=F("retries") + 1)
    TaskStat.objects.filter(pk=stat.pk).update(outstanding=F("outstanding") + 1)


def _maybe_ready(group_id: int, cfg: CurationConfig) -> None:
    """A group is ready when all its claims are taken and none of them is still running."""
    group = TaskGroup.objects.select_for_update(of=("self",), no_key=True).get(pk=group_id)
    if group.status != GroupStatus.OPEN or group.claimed < group.budget:
        return
    members = Trajectory.objects.filter(group=group)
    if members.filter(status=TrajectoryStatus.RUNNING).exists():
        return
    errors = members.filter(status=TrajectoryStatus.ERROR).order_by("-pk")
    if errors.count() > group.retries:  # a member is missing and was not replaced
        last = errors.values_list("pk", "error").first()
        assert last is not None  # errors.count() > group.retries >= 0
        group.status = GroupStatus.SKIPPED
        group.note = storable(
            f"dropped: {errors.count()} members ended in an environment error and "
            f"{group.retries} were replaced (curation.error_retries); trajectory #{last[0]}: "
            f"{last[1]}"
        )
        group.save(update_fields=["status", "note"])
        return
    scored = list(members.filter(status__in=SCORED_STATUSES).values_list("reward", flat=True))
    all_failed = bool(scored) and all((r or 0.0) <= 0.0 for r in scored)
    pool = list(pool_members(task_id=group.task_id).order_by("-pk").values_list("pk", flat=True))
    n_pool = curation.pool_fill_count(
        group_size=len(scored),
        all_failed=all_failed,
        pool_size=len(pool),
        ratio=cfg.pool_ratio,
        enabled=cfg.experience_pool,
    )
    # Rotate through the pool so one demo is not replayed in every group.
    start = group.index % len(pool) if pool else 0
    group.pool_members = (pool[start:] + pool[:start])[:n_pool]
    group.status = GroupStatus.READY
    group.ready_at = timezone.now()
    group.save(update_fields=["status", "ready_at", "pool_members"])
    stat = TaskStat.objects.get(run_id=group.run_id, task_id=group.task_id)
    TaskStatHistory.objects.create(
        run_id=group.run_id,
        task_id=group.task_id,
        success_rate=stat.success_rate if stat.attempts else None,
        rollout_budget=stat.pinned_budget or stat.rollout_budget,
        step_cap=stat.step_cap,
        pool_size=len(pool),
    )
    publish_on_commit(
        run_id=group.run_id,
        kind="group",
        data={"task": group.task_id, "index": group.index, "pool_members": group.pool_members},
    )


def trajectories_abort_cut(trajectories: QuerySet[Trajectory], *, error: str) -> int:
    """End `aborted`, with `error`, the running ones of `trajectories`: episodes a worker's
    death cut, found by whoever took up their slot or shard. Returns how many."""
    running = list(
        trajectories.filter(status=TrajectoryStatus.RUNNING).values_list("pk", flat=True)
    )
    for trajectory_id in running:
        trajectory_finish(
            trajectory_id=trajectory_id, status=TrajectoryStatus.ABORTED, reward=None, error=error
        )
    return len(running)


def trajectories_abort_orphans(
    *,
    run_id: int,
    stale_after_s: float,
    alive_slots: Collection[str] = (),
    dead_eval_jobs: Collection[int] = (),
) -> int:
    """Running trajectories whose slot stopped heart-beating (a killed worker) end as
    `aborted` with the reason, so their group can complete. Returns how many.

    `alive_slots`: names of slots known alive another way (their Redis lease is held): a
    database outage stops every heartbeat for its length, and must not abort the episodes
    it only paused.

    An evaluation episode has no slot and no heartbeat of its own, and may rightly run for
    minutes: it is ended only when its job is in `dead_eval_jobs` (a scheduled job none of
    whose shards holds its lease), never for its age."""
    from datetime import timedelta

    from django.db.models import Q

    cutoff = timezone.now() - timedelta(seconds=stale_after_s)
    slotless = Q(env_slot__isnull=True, started_at__lt=cutoff)
    orphans = Trajectory.objects.filter(run_id=run_id, status=TrajectoryStatus.RUNNING).filter(
        (slotless & (Q(eval_job__isnull=True) | Q(eval_job_id__in=list(dead_eval_jobs))))
        | Q(env_slot__last_heartbeat__lt=cutoff)
    )
    count = 0
    # Three columns, not two model instances a row: with heartbeats late (a busy database
    # delays them) every running trajectory of the run matches, and nearly all are skipped.
    rows = orphans.values_list("pk", "env_slot__name", "env_slot__last_heartbeat")
    for traj_id, slot_name, beat in rows:
        if slot_name is not None and slot_name in alive_slots:
            continue
        trajectory_finish(
            trajectory_id=traj_id,
            status=TrajectoryStatus.ABORTED,
            reward=None,
            error=f"the env worker stopped mid-episode (its last heartbeat: {beat:%Y-%m-%d %H:%M:%S} UTC)"
            if beat
            else "the env worker stopped mid-episode",
        )
        count += 1
    return count
