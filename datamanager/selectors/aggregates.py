"""Time-bucketed aggregates shared by the run page's reads (`datamanager.selectors.charts`,
`datamanager.selectors.env_health`): the bucket width, the regrouping of SQL rows into it, and one
grouped pass over a run's finished trajectories that every outcome chart folds from.

Buckets are computed in SQL as whole seconds since the epoch divided by the bucket width
(`bucket_index`), not with Django's `Trunc`: on SQLite `Trunc` and datetime arithmetic are
Python functions called per row, and each chart's own `Trunc` query over 10,000 trajectories
cost ~50 ms; with the health charts the chart JSON took 660 ms (bench/pages.py). One pass
returns a bucket x task x host x outcome table of a few thousand rows at most, which the
charts fold in Python. Plain reads: safe from any process, no locks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import (
    Case,
    Count,
    Expression,
    F,
    FloatField,
    Func,
    IntegerField,
    Q,
    Sum,
    Value,
    When,
)
from django.utils import timezone

from datamanager.models import Run, Trajectory, TrajectoryStatus

NOT_ENV = ("inference:", "storage:", "database:")

_STEPS = {"minute": (1, 2, 5, 10, 15, 30), "hour": (1, 2, 3, 6, 12), "day": (1, 2, 7, 14, 30)}
_UNIT = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}


def env_error_q() -> Q:
    """Rollouts that ended in an environment error: `error`, but not for the policy
    server's (`inference:`), the database's or the object store's (`storage:`) sake, which
    say nothing about the environment's host."""
    q = Q(status=TrajectoryStatus.ERROR)
    for prefix in NOT_ENV:
        q &= ~Q(error__startswith=prefix)
    return q


# Left out of training: ended in error or aborted, or rejected (by a curator or a label).
LEFT_OUT = Q(status__in=(TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED)) | Q(rejected=True)


class EpochSeconds(Func):
    """Seconds since the epoch of a datetime expression (a float), computed by the database:
    SQLite's julianday() is C and keeps milliseconds, where `Trunc` and datetime arithmetic
    call Python per row."""

    output_field = FloatField()

    def as_sqlite(self, compiler, connection, **extra):
        template = "((julianday(%(expressions)s) - 2440587.5) * 86400.0)"
        return super().as_sql(compiler, connection, template=template, **extra)

    def as_postgresql(self, compiler, connection, **extra):
        template = "CAST(EXTRACT(EPOCH FROM %(expressions)s) AS double precision)"
        return super().as_sql(compiler, connection, template=template, **extra)


class BucketIndex(Func):
    """floor(epoch seconds / width): which bucket of `width` seconds a datetime falls in."""

    output_field = IntegerField()

    def __init__(self, expression: Expression | F, width: int) -> None:
        super().__init__(EpochSeconds(expression))
        self.width = int(width)

    def as_sql(self, compiler, connection, **extra):
        template = f"CAST(FLOOR(%(expressions)s / {self.width}) AS bigint)"
        return super().as_sql(compiler, connection, template=template, **extra)

    def as_sqlite(self, compiler, connection, **extra):
        # SQLite has no FLOOR before 3.35; the epoch is positive, so truncation is the floor.
        template = f"CAST(%(expressions)s / {self.width} AS INTEGER)"
        return super().as_sql(compiler, connection, template=template, **extra)


def bucket_index(field: str | Expression, width: timedelta) -> BucketIndex:
    """The bucket of `width` a datetime falls in, as an integer (epoch seconds // width)."""
    return BucketIndex(F(field) if isinstance(field, str) else field, int(width.total_seconds()))


def bucket_width(run: Run, *, max_buckets: int = 60) -> timedelta:
    """The bucket width giving at most ~`max_buckets` points over the run's life."""
    start = run.started_at or run.created_at
    end = run.finished_at or timezone.now()
    span = max(end - start, timedelta(minutes=1))
    for kind in ("minute", "hour", "day"):
        for k in _STEPS[kind]:
            if span / (_UNIT[kind] * k) <= max_buckets:
                return _UNIT[kind] * k
    return timedelta(days=30)


def bucket_label(width: timedelta) -> str:
    minutes = int(width.total_seconds() // 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h" if minutes < 1440 else f"{minutes // 1440} d"


def with_times(rows: Iterable[Mapping[str, Any]], width: timedelta) -> list[dict[str, Any]]:
    """Rows whose `b` is a `bucket_index`, with `b` turned into the bucket's start (UTC)."""
    w = int(width.total_seconds())
    starts: dict[int, datetime] = {}
    out = []
    for row in rows:
        b = row["b"]
        if b is not None and b not in starts:
            starts[b] = datetime.fromtimestamp(b * w, tz=UTC)
        out.append({**row, "b": starts.get(b) if b is not None else None})
    return out


def regroup(
    rows: Iterable[dict[str, Any]], keys: tuple[str, ...], sums: tuple[str, ...]
) -> list[dict]:
    """Sum `sums` of rows per (`keys`, bucket `b`), sorted by keys then time."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (*(r[k] for k in keys), r["b"])
        acc = out.setdefault(
            key, {**{k: r[k] for k in keys}, "b": r["b"], **dict.fromkeys(sums, 0)}
        )
        for f in sums:
            acc[f] += r[f] or 0
    return [out[k] for k in sorted(out, key=lambda k: tuple("" if v is None else v for v in k))]


def iso(dt: datetime | None) -> str | None:
    return dt.isoformat() if dt else None


def outcome_rows(*, run: Run, width: timedelta) -> list[dict[str, Any]]:
    """The run's finished trajectories counted per (bucket of finished_at, task, host,
    status, source, rejected, environment error): `n` trajectories and `n_steps` actions."""
    env_err = Case(
        When(env_error_q(), then=Value(1)), default=Value(0), output_field=IntegerField()
    )
    return with_times(
        Trajectory.objects.filter(run=run, finished_at__isnull=False)
        .annotate(b=bucket_index("finished_at", width), env_err=env_err)
        .values("b", "task__name", "env_slot__host", "status", "source", "rejected", "env_err")
        .annotate(n=Count("pk"), n_steps=Sum("length"))
        .order_by(),
        width,
    )


def fold(
    rows: Iterable[dict[str, Any]],
    keys: tuple[str, ...],
    where: Callable[[dict[str, Any]], bool],
    **counts: Callable[[dict[str, Any]], float],
) -> list[dict[str, Any]]:
    """`outcome_rows` kept by `where`, summed per `keys` and bucket: each named count is the
    sum of its function over the rows (e.g. `ok=lambda r: r["n"] * (...)`)."""
    picked = (
        {**{k: r[k] for k in keys}, "b": r["b"], **{name: f(r) for name, f in counts.items()}}
        for r in rows
        if where(r)
    )
    return regroup(picked, keys, tuple(counts))
