"""Where a run's collected steps go: trained, left out by a curation rule that chose to
(entropy selection), left out as stale, lost with their episode (an environment error, an
abort, a rejection), or still waiting; and the training backlog that holds new claims back.

A collected step is a step of one of the run's online training rollouts (a trajectory in a
GRPO group; evaluation episodes and demonstrations are not collected data). Its fate is read
off the step and its trajectory:
- trained: an update used it and the entropy filter kept it (`Step.entropy_kept` not False);
- entropy: an update used it and the high-entropy selection left it out;
- stale: an update found it older than `curation.staleness_k` versions (`Step.stale`);
- lost: its trajectory ended in error, was aborted or rejected, or its group was dropped;
- waiting: none of these yet (its group is open or ready, or its update is running).
The first that applies is the step's fate (a step trained and then its trajectory rejected
by hand was trained).

`training_backlog` is the backpressure rule's input (`curation.backpressure`): the steps of
the run's ready groups, collected and not yet trained. `task_claim` holds new training
claims while they fill `backpressure` updates, so a slot does not collect steps the trainer
would reach only after they went stale.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, Q
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import (
    SCORED_STATUSES,
    GroupStatus,
    Purpose,
    Run,
    Step,
    TrajectoryStatus,
)

FATES = ("trained", "entropy", "stale", "lost", "waiting")


@dataclass(frozen=True)
class Backlog:
    """Collected, untrained steps of ready groups against the backpressure limit."""

    waiting: int
    limit: int  # 0: backpressure off

    @property
    def held(self) -> bool:
        return self.limit > 0 and self.waiting >= self.limit

    def reason(self) -> str:
        return (
            f"trainer behind by {self.waiting} steps (holding new training claims at "
            f"{self.limit}: curation.backpressure)"
        )


def backlog_limit(cfg: RunConfig) -> int:
    """Steps of ready groups at which new training claims are held (0: never)."""
    if cfg.curation.backpressure <= 0:
        return 0
    return max(1, round(cfg.curation.backpressure * cfg.trainer.max_steps_per_update))


def training_backlog(*, run_id: int, cfg: RunConfig) -> Backlog:
    limit = backlog_limit(cfg)
    if not limit:
        return Backlog(waiting=0, limit=0)
    waiting = Step.objects.filter(
        trajectory__group__run_id=run_id,
        trajectory__group__status=GroupStatus.READY,
        trajectory__status__in=SCORED_STATUSES,
        trajectory__rejected=False,
        trained_in_update__isnull=True,
        stale=False,
    ).count()
    return Backlog(waiting=waiting, limit=limit)


@dataclass(frozen=True)
class StepFlow:
    """The fates of the steps collected in one window (`start`, `end`)."""

    start: datetime
    end: datetime
    collected: int
    trained: int
    entropy: int
    stale: int
    lost: int
    waiting: int

    @property
    def minutes(self) -> float:
        return max((self.end - self.start).total_seconds() / 60, 1e-9)

    @property
    def decided(self) -> int:
        """Steps whose fate is settled (everything but the waiting ones)."""
        return self.collected - self.waiting

    def share(self, fate: str) -> float | None:
        """A fate's share of the settled steps (None before any is settled)."""
        return getattr(self, fate) / self.decided if self.decided else None

    @property
    def trained_per_min(self) -> float:
        """Trained actions per minute of the window (by when they were collected)."""
        return self.trained / self.minutes

    @property
    def chosen_share(self) -> float | None:
        """Trained or left out by a rule that chose to (the entropy selection), of the
        settled online steps: what staleness and lost episodes did not take."""
        return (self.trained + self.entropy) / self.decided if self.decided else None


# Lost with its episode: the trajectory ended in error, was aborted or rejected, or its group
# was dropped (a member missing after the error retries).
LOST = (
    Q(trajectory__status__in=(TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED))
    | Q(trajectory__rejected=True)
    | Q(trajectory__group__status=GroupStatus.SKIPPED)
)


def step_flow(*, run: Run, start: datetime | None = None, end: datetime | None = None) -> StepFlow:
    """The fates of the run's collected steps recorded in [start, end) (default: the whole
    run up to now)."""
    start = start or run.created_at
    end = end or timezone.now()
    steps = Step.objects.filter(
        trajectory__run=run,
        trajectory__purpose=Purpose.TRAIN,
        trajectory__group__isnull=False,
        created_at__gte=start,
        created_at__lt=end,
    )
    # One fate a step, first match: used by an update (kept or not by the entropy filter),
    # found stale (a group of only stale steps is then skipped: still stale), lost.
    used = Q(trained_in_update__isnull=False)
    too_old = ~used & Q(stale=True)
    # Aliased: an aggregate may not share a name with a field its filters read (Step.stale).
    counts = steps.aggregate(
        n_collected=Count("pk"),
        n_trained=Count("pk", filter=used & ~Q(entropy_kept=False)),
        n_entropy=Count("pk", filter=used & Q(entropy_kept=False)),
        n_stale=Count("pk", filter=too_old),
        n_lost=Count("pk", filter=~used & ~too_old & LOST),
    )
    counts = {k.removeprefix("n_"): v for k, v in counts.items()}
    settled = counts["trained"] + counts["entropy"] + counts["stale"] + counts["lost"]
    return StepFlow(start=start, end=end, waiting=counts["collected"] - settled, **counts)


def step_flow_windows(*, run: Run, minutes: float = 10, count: int = 6) -> list[StepFlow]:
    """The last `count` windows of `minutes` each, oldest first, the newest ending now
    (windows before the run began are left out)."""
    now = timezone.now()
    width = timedelta(minutes=minutes)
    out = []
    for i in range(count, 0, -1):
        start, end = now - i * width, now - (i - 1) * width
        if end <= run.created_at:
            continue
        out.append(step_flow(run=run, start=max(start, run.created_at), end=end))
    return out
