"""Reads for the trajectory list and inspector: the list's filters, a page of it, its reward
histogram, and one trajectory with its steps.

Plain reads (no locks, no writes), safe from any process. Filters on steps (entropy, IS
weight, policy version, trained in an update) are `EXISTS` subqueries over the indexed step
columns, so a list over 200,000 steps stays a single query per page.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from django.core.paginator import Page, Paginator
from django.db.models import Exists, F, OuterRef, Q, QuerySet

from datamanager.models import FailureLabel, RewardSource, Step, Trajectory, TrajectoryStatus
from datamanager.selectors.aggregates import env_error_q
from rollout.episode import EndReason

# How an episode ended (the runner's `EndReason`, stored in `details`), or the status of one
# that never got to evaluate: the trajectory list's "End reason" choices.
END_REASONS: list[tuple[str, str]] = [
    (EndReason.FINISHED, "finished (the policy said so)"),
    (EndReason.CALL_USER, "call_user"),
    (EndReason.ENV_DONE, "the environment ended it"),
    (EndReason.STEP_CAP, "step cap"),
    (EndReason.PARSE_ERRORS, "unparsable outputs"),
    (TrajectoryStatus.ERROR, "error"),
    (TrajectoryStatus.ABORTED, "aborted"),
]
_NEVER_EVALUATED = (TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED)


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
    reviewed: bool | None = None  # a curator accepted or rejected it

    def to_json(self) -> dict[str, Any]:
        """The set fields, JSON-able (datetimes as ISO 8601): how an export records it."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = value.isoformat() if isinstance(value, datetime) else value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrajectoryFilter:
        kwargs = dict(data)
        for name in ("finished_from", "finished_to"):
            if kwargs.get(name):
                kwargs[name] = datetime.fromisoformat(kwargs[name])
        return cls(**kwargs)


def trajectory_queryset(*, flt: TrajectoryFilter) -> QuerySet[Trajectory]:
    """The trajectories `flt` selects, newest first, with the list's columns only."""
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
        qs = qs.filter(reward_source=RewardSource.HUMAN)
    if flt.in_pool is not None:
        qs = qs.filter(in_pool=flt.in_pool)
    if flt.reviewed is not None:
        qs = qs.filter(reviewed_at__isnull=not flt.reviewed)
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
    if flt.end in _NEVER_EVALUATED:
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
    unranged = replace(flt, reward_min=None, reward_max=None)
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
    """One trajectory (with what the inspector shows beside it) and its steps in order.
    Raises Trajectory.DoesNotExist for an unknown id."""
    traj = Trajectory.objects.select_related(
        "task", "run", "curated_from", "reward_override_by", "env_slot"
    ).get(pk=trajectory_id)
    steps = list(Step.objects.filter(trajectory=traj).order_by("index"))
    return traj, steps


def trajectory_steps(*, trajectory: Trajectory) -> QuerySet[Step]:
    return Step.objects.filter(trajectory=trajectory).order_by("index")


def trajectories_with_task(*, pks: list[int]) -> dict[int, Trajectory]:
    """Trajectories by id with their task (the API's page of a list read by id)."""
    return {t.pk: t for t in Trajectory.objects.filter(pk__in=pks).select_related("task")}


def screenshot_referenced(*, trajectory_id: int, key: str) -> bool:
    """Whether a step of the trajectory stores its screenshot under `key`."""
    return Step.objects.filter(trajectory_id=trajectory_id, screenshot=key).exists()


def failure_label(*, trajectory: Trajectory) -> FailureLabel | None:
    return FailureLabel.objects.select_related("user").filter(trajectory=trajectory).first()
