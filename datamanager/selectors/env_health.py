"""Environment health for the run page: the env error rate per host and per task over time,
a per-host health map, the share of rollouts left out of training, and their alerts.

An environment error is an online rollout that ended `error` for the environment's sake:
not the policy server's (`inference:`), the database's or the object store's (`storage:`),
which say nothing about the host's desktops. Left out of training: rollouts that ended in
error or aborted, or were rejected (by a curator or an `env_bug` label), and steps an
update left out as too stale. Aggregated in SQL: a run with
10,000 trajectories returns a few hundred rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Avg, Count, FloatField, QuerySet
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.utils import timezone

from datamanager.models import (
    FailureKind,
    Run,
    TrainUpdate,
    Trajectory,
    TrajectorySource,
    TrajectoryStatus,
)
from datamanager.selectors.aggregates import (
    LEFT_OUT,
    bucket_width,
    env_error_q,
    fold,
    iso,
    outcome_rows,
)
from datamanager.selectors.labels import label_counts_by_host
from datamanager.selectors.runs import LOST, SERVING_STATUSES, current_slots, slot_silence

WINDOW = timedelta(minutes=15)  # the health map's and the alerts' recent window
MIN_ROLLOUTS = 5  # fewer rollouts in the window raise no alert: one error is not a rate


def _ended(run: Run) -> QuerySet[Trajectory]:
    return Trajectory.objects.filter(
        run=run, source=TrajectorySource.ONLINE, finished_at__isnull=False
    ).exclude(status=TrajectoryStatus.RUNNING)


def _online_ended(r: dict[str, Any]) -> bool:
    return r["source"] == TrajectorySource.ONLINE and r["status"] != TrajectoryStatus.RUNNING


def _series(folded: list[dict[str, Any]], key: str, max_series: int = 40) -> dict[str, dict]:
    """{name: {"t", "rate", "n"}} from folded rows of (key, b, n, bad)."""
    series: dict[str, dict[str, list]] = {}
    for r in folded:
        s = series.setdefault(r[key] or "unknown", {"t": [], "rate": [], "n": []})
        s["t"].append(iso(r["b"]))
        s["rate"].append(r["bad"] / r["n"] if r["n"] else None)
        s["n"].append(r["n"])
    return dict(list(series.items())[:max_series])


def error_rates(*, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The env error rate per bucket, per host and per task (from `outcome_rows`)."""

    def counted(key: str) -> list[dict[str, Any]]:
        return fold(
            rows, (key,), _online_ended, n=lambda r: r["n"], bad=lambda r: r["n"] * r["env_err"]
        )

    return {
        "per_host": _series(counted("env_slot__host"), "env_slot__host"),
        "per_task": _series(counted("task__name"), "task__name"),
    }


def _left_out_row(r: dict[str, Any]) -> int:
    never_scored = (TrajectoryStatus.ERROR, TrajectoryStatus.ABORTED)
    return r["n"] if r["status"] in never_scored or r["rejected"] else 0


def left_out(*, run: Run, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per bucket: the share of ended rollouts left out of training; per update: the share
    of its collected steps left out as stale."""
    folded = [
        r for r in fold(rows, (), _online_ended, n=lambda r: r["n"], bad=_left_out_row) if r["b"]
    ]
    updates = list(
        TrainUpdate.objects.filter(run=run, metrics__kind="rl")
        .order_by("-number")
        .values_list("created_at", "metrics")[:2000]
    )
    updates.reverse()
    stale_t, stale_share = [], []
    for at, metrics in updates:
        stale = int(metrics.get("stale_steps") or 0)
        trained = int(metrics.get("n_samples") or 0)
        if stale + trained:
            stale_t.append(at.isoformat())
            stale_share.append(stale / (stale + trained))
    return {
        "rollouts": {
            "t": [iso(r["b"]) for r in folded],
            "share": [r["bad"] / r["n"] if r["n"] else None for r in folded],
        },
        "stale": {"t": stale_t, "share": stale_share},
    }


@dataclass(frozen=True)
class HostHealth:
    """One host on the health map."""

    host: str
    slots: dict[str, int]  # slots by status (lost ones apart)
    rollouts: int  # ended in the recent window
    env_errors: int  # in the recent window
    env_bug_labels: int  # over the whole run
    reset_ms: float | None  # mean reset time of the window's rollouts
    last_error: str
    sandbox_note: str  # why its sandboxes run without resource limits ("": enforced)
    alert_rate: float  # the run's env.error_rate_alert
    disk: tuple[int, int] | None = None  # (free, total) bytes of its home disk, newest report

    @property
    def disk_note(self) -> str:
        """ "12.3 GB free of 50.0 GB" ("" when no worker of the host reported it)."""
        if self.disk is None:
            return ""
        free, total = self.disk
        return f"{free / 2**30:,.1f} GB free of {total / 2**30:,.1f} GB"

    @property
    def disk_low(self) -> bool:
        """Under 1 GiB or 5% free: a run on it pauses when a write finds no space."""
        return self.disk is not None and (
            self.disk[0] < 2**30 or self.disk[0] < 0.05 * self.disk[1]
        )

    @property
    def error_rate(self) -> float | None:
        return self.env_errors / self.rollouts if self.rollouts else None

    @property
    def error_percent(self) -> float | None:
        return None if self.error_rate is None else 100 * self.error_rate

    @property
    def state(self) -> str:
        """down (its workers stopped heart-beating: lost slots, none live), waiting (no slot
        served now, none lost: between time slices, or queued behind evaluation shards),
        degraded (its error rate is past the alert threshold), errors (some, under it) or
        ok."""
        live = sum(n for status, n in self.slots.items() if status in SERVING_STATUSES)
        if not live:
            return "down" if self.slots.get(LOST) else "waiting"
        rate = self.error_rate or 0.0
        if self.alert_rate and self.rollouts >= MIN_ROLLOUTS and rate > self.alert_rate:
            return "degraded"
        return "errors" if self.env_errors else "ok"


def host_map(*, run: Run) -> list[HostHealth]:
    """Every host that served the run: the slots it serves now (each of the run's slots on
    the host of the worker that served it last), recent errors, env-bug labels, reset time."""
    env_cfg = run.cfg.env
    lost_after, now = env_cfg.silent_after_s, timezone.now()
    slots: dict[str, dict[str, int]] = {}
    last_error: dict[str, str] = {}
    unlimited: dict[str, str] = {}
    disk: dict[str, tuple[datetime, tuple[int, int]]] = {}  # host -> (heartbeat, report)
    exist = {f"{backend}:{index}" for backend, index in env_cfg.slots()}
    rows = current_slots(run=run).filter(key__in=exist)  # slots the run has, as they are now
    for host, status, heartbeat, error, note, free, total in rows.values_list(
        "host",
        "status",
        "last_heartbeat",
        "last_error",
        "sandbox_note",
        "disk_free_bytes",
        "disk_total_bytes",
    ):
        if note:
            unlimited[host] = note
        newer = host not in disk or (heartbeat is not None and heartbeat >= disk[host][0])
        if free is not None and total is not None and heartbeat is not None and newer:
            disk[host] = (heartbeat, (free, total))
        if slot_silence(status, heartbeat, lost_after=lost_after, now=now) is not None:
            status = LOST
        counts = slots.setdefault(host, {})
        counts[status] = counts.get(status, 0) + 1
        if error:
            last_error[host] = error
    since = timezone.now() - WINDOW
    recent: dict[str, dict[str, Any]] = {
        r["env_slot__host"]: dict(r)
        for r in _ended(run)
        .filter(finished_at__gte=since)
        .values("env_slot__host")
        .annotate(
            n=Count("pk"),
            bad=Count("pk", filter=env_error_q()),
            reset=Avg(Cast(KT("details__reset_ms"), FloatField())),
        )
        .order_by()
    }
    labels = label_counts_by_host(run_id=run.pk, label=FailureKind.ENV_BUG)
    hosts = sorted(set(slots) | {h for h in recent if h} | {h for h in labels if h != "unknown"})
    out = []
    for host in hosts:
        r = recent.get(host, {})
        out.append(
            HostHealth(
                host=host,
                slots=dict(sorted(slots.get(host, {}).items())),
                rollouts=r.get("n", 0),
                env_errors=r.get("bad", 0),
                env_bug_labels=labels.get(host, 0),
                reset_ms=r.get("reset"),
                last_error=last_error.get(host, ""),
                sandbox_note=unlimited.get(host, ""),
                alert_rate=env_cfg.error_rate_alert,
                disk=disk[host][1] if host in disk else None,
            )
        )
    return out


def health_alerts(*, run: Run) -> list[str]:
    """Env error rates per host and per task, and the left-out share, past their thresholds
    over the recent window (each alert says what it measured and against what)."""
    cfg = run.cfg
    since = timezone.now() - WINDOW
    recent = _ended(run).filter(finished_at__gte=since)
    alerts = []
    threshold = cfg.env.error_rate_alert
    if threshold > 0:
        for key, what in (("env_slot__host", "host"), ("task__name", "task")):
            rows = (
                recent.values(key)
                .annotate(n=Count("pk"), bad=Count("pk", filter=env_error_q()))
                .filter(n__gte=MIN_ROLLOUTS)
                .order_by(key)
            )
            for r in rows:
                rate = r["bad"] / r["n"]
                if rate > threshold:
                    alerts.append(
                        f"Environment errors on {what} {r[key] or 'unknown'}: {r['bad']} of "
                        f"{r['n']} rollouts ({rate:.0%}) in the last "
                        f"{WINDOW.seconds // 60} minutes ended in an environment error, over "
                        f"the alert threshold {threshold:.0%}. They are left out of training; "
                        "see the host health map and the slots' last errors."
                    )
    share_alert = cfg.trainer.left_out_alert
    agg = recent.aggregate(n=Count("pk"), bad=Count("pk", filter=LEFT_OUT))
    if share_alert > 0 and agg["n"] >= MIN_ROLLOUTS and agg["bad"] / agg["n"] > share_alert:
        alerts.append(
            f"Left out of training: {agg['bad']} of {agg['n']} rollouts ({agg['bad'] / agg['n']:.0%}) "
            f"in the last {WINDOW.seconds // 60} minutes ended in error, were aborted or "
            f"rejected, over the alert threshold {share_alert:.0%}: the trainer sees only the rest."
        )
    latest = (
        TrainUpdate.objects.filter(run=run, metrics__kind="rl", created_at__gte=since)
        .order_by("-number")
        .values_list("number", "metrics")
        .first()
    )
    if share_alert > 0 and latest is not None:
        number, metrics = latest
        stale, trained = int(metrics.get("stale_steps") or 0), int(metrics.get("n_samples") or 0)
        if stale + trained and stale / (stale + trained) > share_alert:
            alerts.append(
                f"Stale steps left out: update {number} left out {stale} of {stale + trained} "
                f"collected steps ({stale / (stale + trained):.0%}) as too stale to train, over "
                f"the alert threshold {share_alert:.0%}: rollouts run too far ahead of the "
                f"trainer ({_stale_remedy(cfg.curation.backpressure)})."
            )
    return alerts


def _stale_remedy(backpressure: float) -> str:
    """What to change when the trainer falls behind. A larger `curation.staleness_k` only
    delays the drops while the slots outpace the trainer: the backlog keeps growing and the
    trainer then trains older steps (docs/benchmarks.md, *Stale steps trained, not dropped*)."""
    if backpressure <= 0:
        return "set curation.backpressure, e.g. 2, so slots hold while the trainer is behind"
    return (
        f"slots hold at curation.backpressure {backpressure:g} updates: "
        "lower it, or add trainer capacity"
    )


def health_chart_data(*, run: Run, rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The health charts' series, bucketed like the run's other charts (`rows`: the run's
    `aggregates.outcome_rows` when the caller has them already)."""
    if rows is None:
        rows = outcome_rows(run=run, width=bucket_width(run))
    return {"errors": error_rates(rows=rows), "left_out": left_out(run=run, rows=rows)}
