"""Read-only selectors for the dashboard. Aggregation happens in the database; lists page.

Every function here is a plain read (no locks, no writes) and is safe from any process.
Time series are bucketed in SQL (`dartboard.aggregates`), so a run with 10,000 trajectories
and 200,000 steps returns a few hundred rows, not the raw history.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.paginator import Page, Paginator
from django.db.models import (
    Avg,
    Count,
    Exists,
    F,
    FloatField,
    IntegerField,
    Max,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
)
from django.db.models.functions import Cast, Coalesce, Now
from django.utils import timezone

from dartboard.aggregates import (
    FINISHED,
    EpochSeconds,
    bucket_index,
    bucket_label,
    bucket_width,
    env_error_q,
    fold,
    iso,
    outcome_rows,
    with_times,
)
from datamanager.config import RunConfig
from datamanager.eval_metrics import wilson_interval
from datamanager.models import (
    EnvSlot,
    EvalJob,
    EvalScope,
    FailureKind,
    PolicyVersion,
    Run,
    Step,
    TaskGroup,
    TaskStat,
    TaskStatHistory,
    TrainUpdate,
    Trajectory,
)
from datamanager.selectors.labels import label_counts_by_task
from workers.leases import redis_client
from workers.runs import run_live_work


def _count_subquery(qs: QuerySet) -> Coalesce:
    """COUNT(*) of a correlated queryset, as an integer subquery (0 when empty)."""
    counted = qs.order_by().values("run").annotate(c=Count("pk")).values("c")
    return Coalesce(Subquery(counted, output_field=IntegerField()), Value(0))


def runs_overview() -> QuerySet[Run]:
    """Runs, newest first, annotated with trajectory count, success rate and policy version.

    Each figure is a correlated subquery, so the three joins do not multiply each other.
    `success_rate` is None for a run with no finished (succeeded/failed) trajectory.
    """
    trajs = Trajectory.objects.filter(run=OuterRef("pk"))
    n_trajs = _count_subquery(trajs)
    n_finished = _count_subquery(trajs.filter(status__in=FINISHED))
    n_success = _count_subquery(trajs.filter(status="succeeded"))
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


def success_rate(succeeded: int, finished: int) -> float | None:
    return succeeded / finished if finished else None


def run_summary(*, run: Run) -> dict[str, Any]:
    """Counts shown on the run page header."""
    agg = Trajectory.objects.filter(run=run).aggregate(
        total=Count("pk"),
        running=Count("pk", filter=Q(status="running")),
        succeeded=Count("pk", filter=Q(status="succeeded")),
        finished=Count("pk", filter=Q(status__in=FINISHED)),
        errors=Count("pk", filter=Q(status="error")),
    )
    agg["success_rate"] = success_rate(agg["succeeded"], agg["finished"])
    agg["policy_version"] = PolicyVersion.objects.filter(run=run).aggregate(v=Max("version"))["v"]
    agg["updates"] = TrainUpdate.objects.filter(run=run).count()
    return agg


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


SERVING_STATUSES = ("starting", "idle", "busy", "recovering")  # a live worker reports these


WALL_STATUSES = (*SERVING_STATUSES, "quarantined", "stopped", "lost")


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

    @property
    def complete(self) -> bool:
        """Every slot of the run is on this page: live events may add new tiles to it."""
        return not self.status and not self.query and self.pages <= 1


def _lost(lost_after: float) -> Q:
    cutoff = timezone.now() - timedelta(seconds=lost_after)
    return Q(status__in=SERVING_STATUSES, last_heartbeat__lt=cutoff)


def run_slots(
    *, run: Run, status: str = "", query: str = "", page: int | str = 1, per_page: int = 60
) -> SlotWall:
    """A page of the run's env slots, with the latest screenshot of each slot's current
    trajectory, filtered by status (`lost` included) and by a substring of the slot's or its
    task's name. Paged, because 1,000 tiles are neither readable nor cheap: the page holds
    `per_page` tiles and counts the rest by status.

    A slot row whose worker stopped heart-beating while it was serving shows as `lost` with
    how long ago: a killed worker cannot say so itself, and a restarted one serves the slot
    under a new row (host:pid:backend:index)."""
    lost_after = RunConfig.from_dict(run.config).env.silent_after_s
    lost = _lost(lost_after)
    rows = EnvSlot.objects.filter(run=run)
    counts = dict(
        rows.exclude(lost).values_list("status").annotate(n=Count("pk")).order_by("status")
    )
    counts["lost"] = rows.filter(lost).count()
    if status == "lost":
        rows = rows.filter(lost)
    elif status:
        rows = rows.filter(status=status).exclude(lost)
    if query:
        rows = rows.filter(
            Q(name__icontains=query) | Q(current_trajectory__task__name__icontains=query)
        )
    paginator = Paginator(rows.order_by("name").values_list("pk", flat=True), per_page)
    current = paginator.get_page(page)
    last_step = Step.objects.filter(trajectory=OuterRef("current_trajectory")).order_by("-index")
    slots = (
        EnvSlot.objects.filter(pk__in=list(current.object_list))
        .annotate(
            step_index=Subquery(last_step.values("index")[:1]),
            step_image=Subquery(last_step.values("screenshot")[:1]),
            step_version=Subquery(last_step.values("policy_version")[:1]),
            task_name=F("current_trajectory__task__name"),
        )
        .order_by("name")
    )
    now = timezone.now()
    tiles = []
    for s in slots:
        shown, error = s.status, s.last_error
        silent = (now - s.last_heartbeat).total_seconds() if s.last_heartbeat else None
        if shown in SERVING_STATUSES and silent is not None and silent > lost_after:
            shown = "lost"
            error = f"no heartbeat for {silent:.0f} s: its worker stopped"
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
    )


@dataclass(frozen=True)
class LiveWorkRow:
    """A running run's slot task or trainer, and whether a live worker holds it."""

    label: str
    state: str  # "live", "queued" or "missing"
    text: str


def live_work_rows(*, run: Run, fold_after: int = 20) -> list[LiveWorkRow]:
    """Who holds each of a running run's slots and its trainer now (Redis leases,
    workers/leases.py); empty unless the run is running. Read in one pipeline (1,000 slots
    were 2,000 round trips per page view); past `fold_after` live slots they are
    counted in one row, and past `fold_after` rows of work without a live worker the rest
    are counted too, so a 1,000-slot run's page lists what needs a look and stays small."""
    if run.status != "running":
        return []
    rows = []
    client = redis_client()
    try:
        works = run_live_work(run_id=run.pk, cfg=RunConfig.from_dict(run.config))
        pipe = client.pipeline(transaction=False)
        for work in works:
            pipe.get(work.lease_key)
            pipe.exists(work.pending_key)
        answers = pipe.execute()
        live_slots = 0
        for work, holder, pending in zip(works, answers[::2], answers[1::2], strict=True):
            if holder is not None:
                live_slots += work.label.startswith("slot ")
                rows.append(LiveWorkRow(work.label, "live", f"held by {holder.decode()}"))
            elif pending:
                rows.append(LiveWorkRow(work.label, "queued", f"queued on {work.queue}"))
            else:
                rows.append(
                    LiveWorkRow(
                        work.label,
                        "missing",
                        "no live worker; the watchdog enqueues it again after "
                        f"{settings.DARTBOARD_WATCHDOG_GRACE_S:.0f} s",
                    )
                )
        if live_slots > fold_after:
            rows = [r for r in rows if r.state != "live" or not r.label.startswith("slot ")]
            rows.insert(0, LiveWorkRow(f"{live_slots} slots", "live", "held by live workers"))
        rest = [r for r in rows if r.state != "live"]
        if len(rest) > fold_after:  # e.g. every slot of a run whose workers are gone
            shown = set(map(id, rest[:fold_after]))
            rows = [r for r in rows if r.state == "live" or id(r) in shown]
            rows.append(
                LiveWorkRow(
                    f"{len(rest) - fold_after} more", "missing", "queued or without a worker"
                )
            )
    except Exception as exc:  # the page still renders; the row says why it cannot tell
        rows.append(LiveWorkRow("workers", "missing", f"Redis unreachable: {exc}"))
    finally:
        client.close()
    return rows


def task_board(*, run: Run, sparkline_points: int = 30) -> list[dict[str, Any]]:
    """Per-task rows: stats, the success-rate history (last N points), pool size."""
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
        {
            "stat": s,
            "history": history.get(s.task_id, [])[-sparkline_points:],
            "group_id": latest_group.get(s.task_id),
            "labels": [
                (kind.value, kind.label, labels.get(s.task_id, {}).get(kind.value, 0))
                for kind in FailureKind
            ],
        }
        for s in stats
    ]


# --- trajectory list -------------------------------------------------------------------


# How an episode ended (rollout/episode.py's end reasons, stored in `details`), or the status
# of one that never got to evaluate.
END_REASONS = [
    ("finished", "finished (the policy said so)"),
    ("call_user", "call_user"),
    ("env_done", "the environment ended it"),
    ("step_cap", "step cap"),
    ("parse_errors", "unparsable outputs"),
    ("error", "error"),
    ("aborted", "aborted"),
]


@dataclass(frozen=True)
class TrajectoryFilter:
    run_id: int | None = None
    task: str = ""
    task_exact: bool = False  # `task` is the whole name, not a part of it
    eval_job_id: int | None = None
    status: str = ""
    reward: str = ""  # "positive", "zero", "none", "human"
    source: str = ""
    policy_version: int | None = None
    in_pool: bool | None = None
    end: str = ""  # an END_REASONS value
    env_error: bool | None = None  # ended in an environment error (aggregates.env_error_q)
    label: str = ""  # a FailureKind value, or "none" for unlabelled
    reward_min: float | None = None  # reward >= reward_min
    reward_max: float | None = None  # reward < reward_max
    # A step of the trajectory with mean token entropy / trainer IS weight in the range.
    entropy_min: float | None = None
    entropy_max: float | None = None
    is_weight_min: float | None = None
    is_weight_max: float | None = None
    group_id: int | None = None
    host: str = ""  # served by a slot on this host
    update: int | None = None  # a step of it was trained in this update (its number)
    finished_from: datetime | None = None
    finished_to: datetime | None = None  # exclusive


def trajectory_queryset(*, flt: TrajectoryFilter) -> QuerySet[Trajectory]:
    qs = Trajectory.objects.select_related("task", "run", "failure_label").only(
        "pk",
        "group_id",
        "details",
        "failure_label__label",
        "status",
        "reward",
        "reward_source",
        "length",
        "started_at",
        "finished_at",
        "source",
        "in_pool",
        "rejected",
        "policy_versions",
        "run__name",
        "task__name",
    )
    if flt.run_id is not None:
        qs = qs.filter(run_id=flt.run_id)
    if flt.task and flt.task_exact:
        qs = qs.filter(task__name=flt.task)
    elif flt.task:
        qs = qs.filter(task__name__icontains=flt.task)
    if flt.eval_job_id is not None:
        qs = qs.filter(eval_job_id=flt.eval_job_id)
    if flt.status:
        qs = qs.filter(status=flt.status)
    if flt.source:
        qs = qs.filter(source=flt.source)
    if flt.reward == "positive":
        qs = qs.filter(reward__gt=0)
    elif flt.reward == "zero":
        qs = qs.filter(reward__lte=0)
    elif flt.reward == "none":
        qs = qs.filter(reward__isnull=True)
    elif flt.reward == "human":
        qs = qs.filter(reward_source="human")
    if flt.in_pool is not None:
        qs = qs.filter(in_pool=flt.in_pool)
    if flt.policy_version is not None:
        # Steps carry the version (indexed); the JSON list is not queryable on SQLite.
        qs = qs.filter(
            Exists(
                Step.objects.filter(trajectory=OuterRef("pk"), policy_version=flt.policy_version)
            )
        )
    return _filter_more(qs, flt).order_by("-started_at", "-pk")


def _filter_more(qs: QuerySet[Trajectory], flt: TrajectoryFilter) -> QuerySet[Trajectory]:
    """The filters the charts and the histogram link to (and the annotation queue's)."""
    if flt.end in ("error", "aborted"):
        qs = qs.filter(status=flt.end)
    elif flt.end:
        qs = qs.filter(details__end_reason=flt.end)
    if flt.env_error is not None:
        qs = qs.filter(env_error_q()) if flt.env_error else qs.exclude(env_error_q())
    if flt.label == "none":
        qs = qs.filter(failure_label__isnull=True)
    elif flt.label:
        qs = qs.filter(failure_label__label=flt.label)
    ranges = {
        "reward__gte": flt.reward_min,
        "reward__lt": flt.reward_max,
        "group_id": flt.group_id,
        "env_slot__host": flt.host or None,
        "finished_at__gte": flt.finished_from,
        "finished_at__lt": flt.finished_to,
    }
    qs = qs.filter(**{lookup: v for lookup, v in ranges.items() if v is not None})
    step_q = Q()
    for field, low, high in (
        ("mean_entropy", flt.entropy_min, flt.entropy_max),
        ("is_weight", flt.is_weight_min, flt.is_weight_max),
    ):
        if low is not None:
            step_q &= Q(**{f"{field}__gte": low})
        if high is not None:
            step_q &= Q(**{f"{field}__lte": high})
    if flt.update is not None:
        step_q &= Q(trained_in_update__run_id=F("trajectory__run_id"))
        step_q &= Q(trained_in_update__number=flt.update)
    if step_q:
        qs = qs.filter(Exists(Step.objects.filter(step_q, trajectory=OuterRef("pk"))))
    return qs


@dataclass(frozen=True)
class RewardBin:
    low: float  # reward >= low
    high: float  # reward < high
    label: str
    count: int


def reward_histogram(
    *, flt: TrajectoryFilter, bins: int = 10, max_rows: int = 100_000
) -> list[RewardBin]:
    """Rewards of the trajectories `flt` selects (its own reward range left aside, so every
    bin stays in view), as bins a click turns into that range. A few distinct rewards (0/1
    success, say) get a bin each; more get `bins` equal-width bins over their range."""
    unranged = TrajectoryFilter(**{**flt.__dict__, "reward_min": None, "reward_max": None})
    rewards: list[float] = sorted(
        r
        for r in trajectory_queryset(flt=unranged)
        .filter(reward__isnull=False)
        .values_list("reward", flat=True)[:max_rows]
        if r is not None
    )
    if not rewards:
        return []
    distinct = sorted(set(rewards))
    if len(distinct) <= bins:
        gaps = [b - a for a, b in itertools.pairwise(distinct)] or [1.0]
        edges = [(v, v + min(gaps) / 2) for v in distinct]
        labels = [f"{v:g}" for v in distinct]
    else:
        lo, hi = distinct[0], distinct[-1]
        width = (hi - lo) / bins
        edges = [(lo + i * width, lo + (i + 1) * width) for i in range(bins)]
        edges[-1] = (edges[-1][0], hi + width * 1e-3)  # the top bin holds the maximum
        labels = [f"{a:.2g}–{b:.2g}" for a, b in edges]
    counts = [0] * len(edges)
    i = 0
    for r in rewards:  # sorted: one pass
        while i < len(edges) - 1 and r >= edges[i][1]:
            i += 1
        counts[i] += edges[i][0] <= r < edges[i][1]
    return [
        RewardBin(low=round(a, 6), high=round(b, 6), label=label, count=n)
        for (a, b), label, n in zip(edges, labels, counts, strict=True)
    ]


def trajectory_page(*, flt: TrajectoryFilter, page: int | str, per_page: int = 50) -> Page:
    return Paginator(trajectory_queryset(flt=flt), per_page).get_page(page)


def trajectory_detail(*, trajectory_id: int) -> tuple[Trajectory, list[Step]]:
    traj = Trajectory.objects.select_related(
        "task", "run", "curated_from", "reward_override_by", "env_slot"
    ).get(pk=trajectory_id)
    steps = list(Step.objects.filter(trajectory=traj).order_by("index"))
    return traj, steps


# --- charts ----------------------------------------------------------------------------


def chart_data(
    *, run: Run, rows: list[dict[str, Any]] | None = None, max_tasks: int = 40
) -> dict[str, Any]:
    """Every series the run page charts, bucketed in SQL. See `dartboard.figures`.
    `rows`: the run's `aggregates.outcome_rows` when the caller has them already."""
    width = bucket_width(run)
    minutes = width.total_seconds() / 60
    if rows is None:
        rows = outcome_rows(run=run, width=width)

    def finished(r: dict[str, Any]) -> bool:
        return r["status"] in FINISHED

    def n(r: dict[str, Any]) -> int:
        return r["n"]

    def ok(r: dict[str, Any]) -> int:
        return r["n"] if r["status"] == "succeeded" else 0

    success = [
        {"t": iso(r["b"]), "n": r["n"], "rate": r["ok"] / r["n"] if r["n"] else None}
        for r in fold(rows, (), finished, n=n, ok=ok)
    ]
    per_task: dict[str, list[tuple[str | None, float]]] = {}
    for r in fold(rows, ("task__name",), finished, n=n, ok=ok):
        per_task.setdefault(r["task__name"], []).append((iso(r["b"]), r["ok"] / r["n"]))

    # A task's budget and step cap, averaged per bucket like every other series: one point
    # per finished group made 13,500 points (1.1 MB, 300 ms) at 1,000,000 steps.
    history: dict[str, dict[str, list]] = {}
    for r in with_times(
        TaskStatHistory.objects.filter(run=run)
        .annotate(b=bucket_index("at", width))
        .values("task__name", "b")
        .annotate(n=Count("pk"), budget=Sum("rollout_budget"), cap=Sum("step_cap"))
        .order_by("task__name", "b"),
        width,
    ):
        h = history.setdefault(r["task__name"], {"t": [], "budget": [], "step_cap": []})
        h["t"].append(iso(r["b"]))
        h["budget"].append(round(r["budget"] / r["n"], 2))
        h["step_cap"].append(round(r["cap"] / r["n"], 2))

    # Actions are counted per finished trajectory (its length), not per Step row: bucketing
    # 200,000 step timestamps costs a second on SQLite, 10,000 trajectories a few ms.
    rates = fold(rows, (), lambda r: True, n=n, n_steps=lambda r: r["n_steps"] or 0)
    traj_rate: dict[str, float] = {}
    action_rate: dict[str, float] = {}
    for r in rates:
        t = iso(r["b"])
        assert t is not None  # outcome rows are finished trajectories
        traj_rate[t] = r["n"] / minutes
        action_rate[t] = (r["n_steps"] or 0) / minutes
    times = sorted(set(traj_rate) | set(action_rate))
    throughput = {
        "t": times,
        "actions_per_min": [action_rate.get(t, 0) for t in times],
        "trajectories_per_min": [traj_rate.get(t, 0) for t in times],
    }

    return {
        "bucket": bucket_label(width),
        "success": success,
        "per_task": dict(list(per_task.items())[:max_tasks]),
        "history": dict(list(history.items())[:max_tasks]),
        "throughput": throughput,
        "utilisation": utilisation(run=run, width=width),
        "updates": training_metrics(run=run),
        "groups": group_points(run=run),
        "versions": version_success(run=run),
        "run_id": run.pk,
        "bucket_s": width.total_seconds(),
    }


def version_success(*, run: Run) -> dict[str, list[dict[str, Any]]]:
    """Greedy success per policy version from the run's finished scheduled evaluations, per
    scope (training instances, held-out seeds): {scope: [{version, ok, scored, rate, low,
    high}]}, with the 95% Wilson interval (the evaluation report's)."""
    scopes = (EvalScope.TRAIN_INSTANCES, EvalScope.HELDOUT)
    rows = (
        Trajectory.objects.filter(
            eval_job__run=run, eval_job__scope__in=scopes, eval_job__status="finished"
        )
        .values("eval_job_id", "eval_job__scope", "eval_job__policy_version")
        .annotate(
            ok=Count("pk", filter=Q(status="succeeded")),
            scored=Count("pk", filter=Q(status__in=FINISHED)),
        )
        .order_by("eval_job__policy_version", "eval_job_id")
    )
    out: dict[str, list[dict[str, Any]]] = {str(scope): [] for scope in scopes}
    for r in rows:
        if not r["scored"] or r["eval_job__policy_version"] is None:
            continue
        low, high = wilson_interval(r["ok"], r["scored"])
        out[r["eval_job__scope"]].append(
            {
                "version": r["eval_job__policy_version"],
                "ok": r["ok"],
                "scored": r["scored"],
                "rate": r["ok"] / r["scored"],
                "low": low,
                "high": high,
            }
        )
    return out


def group_points(*, run: Run, limit: int = 300) -> list[dict[str, Any]]:
    """The run's latest `limit` groups with an ended member: when the last one ended, its
    task, the members' mean reward and count (the groups chart; a point opens the group)."""
    scored = Q(trajectories__status__in=FINISHED)
    rows = (
        TaskGroup.objects.filter(run=run)
        .annotate(
            n=Count("trajectories", filter=scored),
            mean=Avg("trajectories__reward", filter=scored),
            last=Max("trajectories__finished_at"),
        )
        .filter(n__gt=0)
        .order_by("-last", "-pk")
        .values("pk", "index", "status", "task__name", "n", "mean", "last")[:limit]
    )
    return [
        {
            "id": r["pk"],
            "t": iso(r["last"]),
            "task": r["task__name"],
            "index": r["index"],
            "status": r["status"],
            "n": r["n"],
            "mean": r["mean"],
        }
        for r in reversed(list(rows))
    ]


def utilisation(*, run: Run, width: timedelta) -> dict[str, Any]:
    """Env busy share per bucket and trainer busy share per bucket.

    Env: the summed duration of trajectories (start -> finish, or now while running) that
    started in a bucket, over the slot-time of the run's slots in that bucket. A trajectory
    longer than a bucket is credited to the bucket it started in, which is exact enough at
    the chart's resolution. Trainer: summed `metrics.duration_s` of updates per bucket.
    Durations are computed by the database (`EpochSeconds`).
    """
    n_slots = EnvSlot.objects.filter(run=run).count() or 1
    seconds = EpochSeconds(Coalesce(F("finished_at"), Now())) - EpochSeconds(F("started_at"))
    rows = with_times(
        Trajectory.objects.filter(run=run, source="online")
        .annotate(b=bucket_index("started_at", width))
        .values("b")
        .annotate(busy=Sum(seconds))
        .order_by("b"),
        width,
    )
    slot_seconds = n_slots * width.total_seconds()
    env = {
        "t": [iso(r["b"]) for r in rows],
        "share": [min(1.0, (r["busy"] or 0) / slot_seconds) for r in rows],
    }
    trainer_rows = with_times(
        TrainUpdate.objects.filter(run=run)
        .annotate(
            b=bucket_index("created_at", width), d=Cast(F("metrics__duration_s"), FloatField())
        )
        .values("b")
        .annotate(busy=Sum("d"))
        .order_by("b"),
        width,
    )
    trainer = {
        "t": [iso(r["b"]) for r in trainer_rows],
        "share": [min(1.0, (r["busy"] or 0.0) / width.total_seconds()) for r in trainer_rows],
    }
    return {"env": env, "trainer": trainer, "slots": n_slots}


def training_metrics(*, run: Run, limit: int = 2000) -> dict[str, Any]:
    """Per-update metrics (the last `limit` updates) and the latest staleness histogram."""
    rows = list(
        TrainUpdate.objects.filter(run=run)
        .order_by("-number")
        .values_list("number", "policy_version", "metrics")[:limit]
    )
    rows.reverse()
    scalar_keys: list[str] = []
    for _, _, m in rows:
        for k, v in (m or {}).items():
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in scalar_keys:
                scalar_keys.append(k)
    series = {k: [(m or {}).get(k) for _, _, m in rows] for k in scalar_keys}
    staleness = {}
    if rows:
        raw = (rows[-1][2] or {}).get("staleness") or {}
        if isinstance(raw, dict):
            staleness = {str(k): v for k, v in raw.items()}
    return {
        "number": [n for n, _, _ in rows],
        "series": series,
        "staleness": staleness,
        "latest_version": rows[-1][1] if rows else None,
        "gap_alert": RunConfig.from_dict(run.config).trainer.logprob_gap_alert,
    }


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def dead_time_notes(*, run: Run) -> list[str]:
    """What a running run is busy with where no chart moves, and roughly how long it will
    take: the behaviour-cloning warm start (from its updates so far) and each scheduled
    evaluation under way (from its episodes so far)."""
    if run.status != "running":
        return []
    notes = []
    cfg = RunConfig.from_dict(run.config)
    planned = cfg.trainer.warm_start_bc_updates
    warm = list(
        TrainUpdate.objects.filter(run=run, metrics__kind="warm_start").values_list(
            "metrics__duration_s", flat=True
        )
    )
    if planned and len(warm) < planned:
        left = planned - len(warm)
        if warm:
            per = sum(float(d or 0) for d in warm) / len(warm)
            eta = f"about {_minutes(per * left)} left ({per:.0f} s an update so far)"
        else:
            eta = "the first update's time gives the estimate"
        notes.append(
            f"Warm start: behaviour cloning on the experience pool, {len(warm)} of {planned} "
            f"updates done, {eta}; RL and the first RL version follow it."
        )
    now = timezone.now()
    for job in EvalJob.objects.filter(run=run, status__in=("queued", "running")).order_by("pk"):
        what = EvalScope(job.scope).label if job.scope else "its tasks"
        if job.done:
            per = (now - job.created_at).total_seconds() / job.done
            eta = f"about {_minutes(per * (job.total - job.done))} left"
        else:
            eta = "waiting for a free env slot" if job.status == "queued" else "starting"
        notes.append(
            f"Evaluating v{job.policy_version} greedily on {what}: {job.done} of {job.total} "
            f"episodes, {eta} (it shares the env slots with training)."
        )
    return notes


def run_alerts(*, run: Run) -> list[str]:
    """Health signals past their thresholds, for the run page (each says what it measured,
    the threshold, and what it may mean)."""
    alerts = []
    trainer = RunConfig.from_dict(run.config).trainer
    stale = _stale_serving(run=run, behind=trainer.stale_serving_alert)
    if stale:
        alerts.append(stale)
    threshold = trainer.logprob_gap_alert
    latest = (
        TrainUpdate.objects.filter(run=run, metrics__logprob_gap_tokens__gt=0)
        .order_by("-number")
        .values_list("number", "policy_version", "metrics")
        .first()
    )
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
    newest = PolicyVersion.objects.filter(run=run).aggregate(v=Max("version"))["v"]
    if not behind or newest is None:
        return ""
    last_step = Step.objects.filter(trajectory=OuterRef("pk")).order_by("-index")
    running = (
        Trajectory.objects.filter(run=run, status="running")
        .annotate(
            step_version=Subquery(last_step.values("policy_version")[:1]),
            step_at=Subquery(last_step.values("created_at")[:1]),
        )
        .filter(step_version__isnull=False, step_version__lte=newest - behind)
        .select_related("env_slot")
        .order_by("step_version", "pk")
    )
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
