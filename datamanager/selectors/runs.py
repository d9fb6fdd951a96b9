"""Reads for the runs list, the run page's header and its task board.

Plain reads (no locks, no writes), safe from any process. Counts are aggregated by the
database, one correlated subquery per figure, so a run with 10,000 trajectories costs a few
queries, not a row per trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, IntegerField, Max, OuterRef, Q, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from core.artifacts import is_ref
from datamanager.models import (
    SCORED_STATUSES,
    EnvSlot,
    FailureKind,
    Host,
    PlacementState,
    PolicyVersion,
    Run,
    RunPlacement,
    RunStatus,
    SlotStatus,
    TaskGroup,
    TaskStat,
    TaskStatHistory,
    TrainUpdate,
    Trajectory,
    TrajectoryStatus,
)
from datamanager.policies import ORACLE_POLICY, policy_path
from datamanager.selectors.labels import label_counts_by_task


def _count_subquery(qs: QuerySet) -> Coalesce:
    """COUNT(*) of a correlated queryset, as an integer subquery (0 when empty)."""
    counted = qs.order_by().values("run").annotate(c=Count("pk")).values("c")
    return Coalesce(Subquery(counted, output_field=IntegerField()), Value(0))


def runs_overview() -> QuerySet[Run]:
    """Runs, newest first, annotated with trajectory count, finished and succeeded counts
    (`success_rate` turns them into a rate) and policy version.

    Each figure is a correlated subquery, so the three joins do not multiply each other.
    """
    trajs = Trajectory.objects.filter(run=OuterRef("pk"))
    n_trajs = _count_subquery(trajs)
    n_finished = _count_subquery(trajs.filter(status__in=SCORED_STATUSES))
    n_success = _count_subquery(trajs.filter(status=TrajectoryStatus.SUCCEEDED))
    version = Subquery(
        PolicyVersion.objects.filter(run=OuterRef("pk")).order_by("-version").values("version")[:1]
    )
    return (
        Run.objects.select_related("owner")
        .annotate(
            n_trajectories=n_trajs,
            n_finished=n_finished,
            n_succeeded=n_success,
            current_version=version,
        )
        .order_by("-created_at")
    )


# A live worker reports these; a slot in one of them whose heartbeat stopped is lost.
SERVING_STATUSES = (
    SlotStatus.STARTING,
    SlotStatus.IDLE,
    SlotStatus.BUSY,
    SlotStatus.RECOVERING,
    SlotStatus.HELD,
)
LOST = "lost"  # not a stored status: a serving slot whose worker went silent


def lost_slots_q(*, lost_after: float, now: datetime | None = None) -> Q:
    """The slots whose worker stopped heart-beating while serving (a killed worker cannot
    say so itself): silent for over `lost_after` seconds (the run's env.silent_after_s)."""
    cutoff = (now or timezone.now()) - timedelta(seconds=lost_after)
    return Q(status__in=SERVING_STATUSES, last_heartbeat__lt=cutoff)


def slot_silence(
    status: str, heartbeat: datetime | None, *, lost_after: float, now: datetime
) -> float | None:
    """Seconds a serving slot has been silent when that makes it lost (the same rule as
    `lost_slots_q`, for a row already read); None when it is not lost."""
    if status not in SERVING_STATUSES or heartbeat is None:
        return None
    silent = (now - heartbeat).total_seconds()
    return silent if silent > lost_after else None


def current_slots(*, run: Run) -> QuerySet[EnvSlot]:
    """The run's env slots as they are now: per slot (`EnvSlot.key`), the row of the worker
    that served it last (the newest heartbeat). Rows of workers it moved away from (a time
    slice ended, a worker restarted) are its history, not slots of their own."""
    newest = (
        EnvSlot.objects.filter(run_id=run.pk, key=OuterRef("key"))
        .order_by("-last_heartbeat", "-pk")
        .values("pk")[:1]
    )
    return EnvSlot.objects.filter(run=run, pk=Subquery(newest))


def success_rate(succeeded: int, finished: int) -> float | None:
    """None for no finished (succeeded/failed) trajectory: no rate, rather than 0%."""
    return succeeded / finished if finished else None


@dataclass(frozen=True)
class RunSummary:
    """The counts on the run page's header."""

    total: int
    running: int
    succeeded: int
    finished: int  # succeeded or failed
    errors: int
    success_rate: float | None
    policy_version: int | None  # the newest published, None before the first
    updates: int


def run_summary(*, run: Run) -> RunSummary:
    """Counts shown on the run page header."""
    agg = Trajectory.objects.filter(run=run).aggregate(
        total=Count("pk"),
        running=Count("pk", filter=Q(status=TrajectoryStatus.RUNNING)),
        succeeded=Count("pk", filter=Q(status=TrajectoryStatus.SUCCEEDED)),
        finished=Count("pk", filter=Q(status__in=SCORED_STATUSES)),
        errors=Count("pk", filter=Q(status=TrajectoryStatus.ERROR)),
    )
    return RunSummary(
        **agg,
        success_rate=success_rate(agg["succeeded"], agg["finished"]),
        policy_version=PolicyVersion.objects.filter(run=run).aggregate(v=Max("version"))["v"],
        updates=TrainUpdate.objects.filter(run=run).count(),
    )


@dataclass
class TaskRow:
    """One task on the task board. Not frozen: the view adds its sparkline for the template."""

    stat: TaskStat
    history: list[float]  # the success-rate history, oldest first
    group_id: int | None  # the task's latest group
    labels: list[tuple[str, str, int]]  # (FailureKind value, its label, rollouts so labelled)


def task_board(*, run: Run, sparkline_points: int = 30) -> list[TaskRow]:
    """Per-task rows: stats, the success-rate history (last N points), the latest group and
    the failure labels of the task's rollouts."""
    stats = list(TaskStat.objects.filter(run=run).select_related("task").order_by("task__name"))
    history: dict[int, list[float]] = {}
    rows = (
        TaskStatHistory.objects.filter(run=run, success_rate__isnull=False)
        .order_by("at", "pk")
        .values_list("task_id", "success_rate")
    )
    for task_id, rate in rows:
        assert rate is not None  # filtered on success_rate__isnull=False
        history.setdefault(task_id, []).append(rate)
    latest_group = dict(
        TaskGroup.objects.filter(run=run)
        .values("task_id")
        .annotate(last=Max("pk"))
        .values_list("task_id", "last")
        .order_by()
    )
    labels = label_counts_by_task(run_id=run.pk)
    return [
        TaskRow(
            stat=s,
            history=history.get(s.task_id, [])[-sparkline_points:],
            group_id=latest_group.get(s.task_id),
            labels=[
                (kind.value, kind.label, labels.get(s.task_id, {}).get(kind.value, 0))
                for kind in FailureKind
            ],
        )
        for s in stats
    ]


def run_own_router(*, run_id: int) -> str:
    """The URL of the run's own router (a host agent placed it), or "" when it uses the
    shared rollout service or has none."""
    url = (
        RunPlacement.objects.filter(run_id=run_id)
        .exclude(state=PlacementState.ENDED)
        .values_list("router_url", flat=True)
        .first()
    )
    return url or ""


def run_router_url(*, run_id: int) -> str:
    """The router a run's env slots and trainer talk to: its own (a host agent's placement),
    else the shared rollout service's."""
    return run_own_router(run_id=run_id) or settings.DARTBOARD_INFERENCE_URLS[0]


def run_current_policy(*, run: Run) -> tuple[int, str]:
    """(version, checkpoint) the run's rollouts should use now: the newest version's artifact
    reference (a version published before the store, its directory), else the run's policy."""
    latest = PolicyVersion.objects.filter(run=run).order_by("-version").first()
    if latest is not None:
        return latest.version, latest.artifact or latest.checkpoint
    policy = run.cfg.policy
    if is_ref(policy):  # each inference host fetches the base model itself
        return 0, policy
    return 0, str(policy_path(policy))


HOST_ALIVE_S = 60.0  # a host agent reports every 10 s


def processes_per_run() -> bool:
    """Whether a started run waits for a host agent to start its own processes
    (DARTBOARD_PROCESSES: per-run; auto while an agent has reported in the last minute) or
    runs on the shared rollout service and queues."""
    mode = settings.DARTBOARD_PROCESSES
    if mode == "auto":
        recent = timezone.now() - timedelta(seconds=HOST_ALIVE_S)
        return Host.objects.filter(last_seen__gte=recent).exists()
    return mode == "per-run"


def run_holding_shared_workers(*, besides: int) -> Run | None:
    """The model run, other than run `besides`, that holds the shared rollout service: running
    or paused with no live placement (no host agent runs processes of its own for it), its
    policy a model (the scripted oracle uses no inference worker). The shared inference
    workers serve one policy at a time, so a second model run there would switch its
    weights. None when there is none."""
    own = RunPlacement.objects.exclude(state=PlacementState.ENDED).values("run_id")
    shared = (
        Run.objects.filter(status__in=(RunStatus.RUNNING, RunStatus.PAUSED))
        .exclude(pk=besides)
        .exclude(pk__in=own)
        .order_by("pk")
    )
    return next((run for run in shared if run.cfg.policy != ORACLE_POLICY), None)


def gpu_hosts() -> dict[str, int]:
    """Hosts whose agent reported GPUs its torch can use: name -> how many."""
    return {
        host.name: len(host.gpus)
        for host in Host.objects.filter(cuda_torch=True)
        if isinstance(host.gpus, list) and host.gpus
    }


def largest_gpu_gib() -> float | None:
    """The memory of the largest GPU a host agent has reported that its torch can use
    (GiB); None when no such host has reported."""
    sizes = [
        float(gpu["memory_gib"])
        for host in Host.objects.filter(cuda_torch=True)
        for gpu in host.gpus
        if isinstance(gpu, dict) and "memory_gib" in gpu
    ]
    return max(sizes) if sizes else None


@dataclass(frozen=True)
class CheckpointDisk:
    """What a run's published versions take on disk (as each one's trainer measured it)."""

    versions: int
    kept: int  # versions whose weights are kept
    weights_bytes: int  # of the kept versions
    state_bytes: int  # optimizer states of the newest trainer.optimizer_states_kept versions
    version_weights_bytes: int  # the newest version's
    version_state_bytes: int


def checkpoint_disk(*, run: Run, states_kept: int) -> CheckpointDisk | None:
    """None before the first version."""
    rows = list(
        PolicyVersion.objects.filter(run=run)
        .order_by("-version")
        .values_list("weights_bytes", "state_bytes", "pruned_at")
    )
    if not rows:
        return None
    kept = [r for r in rows if r[2] is None]
    return CheckpointDisk(
        versions=len(rows),
        kept=len(kept),
        weights_bytes=sum(r[0] for r in kept),
        state_bytes=sum(r[1] for r in rows[:states_kept]),
        version_weights_bytes=rows[0][0],
        version_state_bytes=rows[0][1],
    )


def run_find(*, run_id: int) -> Run | None:
    return Run.objects.filter(pk=run_id).first()


def run_status(*, run_id: int) -> str | None:
    """The run's status alone (a poll that needs nothing else); None for no such run."""
    return Run.objects.values_list("status", flat=True).filter(pk=run_id).first()


def runs_listing() -> QuerySet[Run]:
    """Runs with their owner, placement host and sweep membership, as the API lists them."""
    return Run.objects.select_related("owner", "placement__host", "sweep_member")


def run_task_names(*, run: Run) -> dict[int, str]:
    """Task id -> name for the tasks the run has statistics for (the env wall's labels)."""
    return dict(TaskStat.objects.filter(run=run).values_list("task_id", "task__name"))


def task_stat_find(*, run_id: int, stat_id: int) -> TaskStat | None:
    """One task's statistics row of a run, with its task and run."""
    return TaskStat.objects.select_related("task", "run").filter(pk=stat_id, run_id=run_id).first()
