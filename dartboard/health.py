"""What is up and what is down, for the run page's health line and outage banner.

The web process probes, at most every PROBE_EVERY_S, the services a run needs: Redis (PING),
the database (SELECT 1), the router (GET /health with the service token) and, from the
router's answer, the inference workers; for a running run also its trainer (its Redis lease).
Each service's state is kept with the moment this process first saw it so ("since"), and its
last error; until the state changes, that moment is only the first probe ("up at every check
since"), not when the service came up. An outage is also written to the database
(datamanager.models.ServiceOutage) when it starts and when it ends (the database's own once it is back), so the page can list them
and their durations after a web restart.

The page polls `/runs/<id>/health.json` (static/dartboard/health.js): the live feed rides on
Redis and goes quiet in exactly the outage the banner has to announce.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import redis
from django.conf import settings
from django.db import DatabaseError, connection
from django.utils import timezone

from datamanager.live_work import trainer_work
from datamanager.selectors.runs import processes_per_run, run_own_router
from datamanager.services.outages import service_outage_close, service_outage_open
from rollout.auth import bearer

log = logging.getLogger("dartboard.health")

PROBE_EVERY_S = 2.0
UP, DOWN, UNKNOWN = "up", "down", "unknown"
LABELS = {
    "redis": "Redis",
    "database": "Database",
    "router": "Router",
    "inference": "Inference workers",
    "trainer": "Trainer",
}


@dataclass(frozen=True)
class Probe:
    """One probe's answer."""

    state: str  # up / down / unknown
    detail: str = ""  # "2/2 active", "held by host:pid:trainer:3"
    error: str = ""  # why it is down (or unknown)


@dataclass(frozen=True)
class ServiceHealth:
    service: str  # redis, database, router, inference, trainer
    state: str
    since: datetime
    detail: str
    last_error: str
    last_error_at: datetime | None
    # This process saw the state change (it went down, or came back). If not, `since` is
    # only this web process's first probe, not when the service came up.
    changed: bool = False

    @property
    def label(self) -> str:
        return LABELS[self.service]

    @property
    def since_word(self) -> str:
        """What `since` is, for the health line: "Redis up {since_word} 10:59:02"."""
        return "since" if self.changed else "at every check since"

    def as_json(self) -> dict[str, Any]:
        return {
            "service": self.service,
            "label": self.label,
            "state": self.state,
            "since": self.since.isoformat(),
            "detail": self.detail,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at.isoformat() if self.last_error_at else None,
            "changed": self.changed,
            "since_word": self.since_word,
        }


def probe_redis() -> Probe:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=2)
    try:
        client.ping()
        return Probe(UP)
    except redis.exceptions.RedisError as exc:
        return Probe(DOWN, error=f"{type(exc).__name__}: {exc}")
    finally:
        client.close()


def probe_database() -> Probe:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return Probe(UP, detail=connection.vendor)
    except DatabaseError as exc:
        if not connection.in_atomic_block:
            connection.close()  # the next probe (or request) opens a fresh one
        return Probe(DOWN, error=f"{type(exc).__name__}: {str(exc).strip()}")


def probe_rollout(url: str | None = None) -> tuple[Probe, Probe]:
    """The router (the shared one by default) and, from its /health, the inference workers
    behind it."""
    url = (url or settings.DARTBOARD_INFERENCE_URLS[0]).rstrip("/")
    try:
        # The inference token, the least the router's detailed /health takes (the master
        # never leaves the web and the workers).
        response = httpx.get(
            f"{url}/health", headers=bearer(settings.DARTBOARD_INFERENCE_TOKEN), timeout=2.0
        )
        health = response.json()
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{url}: {type(exc).__name__}: {exc}"
        return Probe(DOWN, error=error), Probe(UNKNOWN, error="the router does not answer")
    workers = health.get("workers") or []
    if not isinstance(workers, list):  # an inference worker itself, not the router
        workers = [{"status": "active" if health.get("status") == "ok" else "down"}]
    statuses = [w.get("status") for w in workers]
    active = statuses.count("active")
    # A worker taking new weights (one at a time, or all at once for the synchronous
    # baseline) is not an outage: requests wait for it.
    syncing = sum(status in ("stale", "draining", "loading") for status in statuses)
    detail = f"{active}/{len(workers)} active" + (f", {syncing} reloading" if syncing else "")
    router = Probe(UP, detail=url)
    if active or syncing:
        return router, Probe(UP, detail=detail)
    errors = "; ".join(
        f"{w.get('url', '?')}: {w.get('status')} {w.get('last_error', '')}".strip() for w in workers
    )
    return router, Probe(DOWN, detail=detail, error=errors or "no inference worker registered")


def probe_trainer(run_id: int, redis_up: bool) -> Probe:
    """A running run's trainer is up while a worker holds its lease (workers/leases.py)."""
    if not redis_up:
        return Probe(UNKNOWN, error="Redis is down: the trainer's lease cannot be read")
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=2)
    try:
        holder = client.get(trainer_work(run_id=run_id, mode="decoupled").lease_key)
    except redis.exceptions.RedisError as exc:
        return Probe(UNKNOWN, error=f"{type(exc).__name__}: {exc}")
    finally:
        client.close()
    if holder is None:
        return Probe(DOWN, error="no worker holds the trainer's lease (the watchdog restarts it)")
    name = holder.decode() if isinstance(holder, bytes) else str(holder)
    return Probe(UP, detail=f"held by {name}")


class HealthBoard:
    """This process's view of each service: state since when, last error, and the outage
    rows it owes the database. Thread-safe; one per process (`BOARD`)."""

    def __init__(self, clock: Callable[[], datetime] = timezone.now) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._state: dict[str, tuple[str, datetime, str]] = {}  # key -> (state, since, detail)
        self._errors: dict[str, tuple[str, datetime]] = {}
        self._changed: set[str] = set()  # keys seen in more than one state
        self._unwritten: list[tuple[str, datetime, datetime, str]] = []  # closed, not stored
        self._probed_at = 0.0
        self._cache: dict[str, Probe] = {}

    def observe(self, key: str, probe: Probe, *, db_up: bool) -> ServiceHealth:
        """Fold one probe into the board and return the service's health."""
        now = self.clock()
        with self._lock:
            before = self._state.get(key)
            if probe.error:
                self._errors[key] = (probe.error, now)
            if before is None or before[0] != probe.state:
                if before is not None:
                    self._changed.add(key)
                self._state[key] = (probe.state, now, probe.detail)
                self._transition(key, before, probe, now, db_up=db_up)
            else:
                self._state[key] = (before[0], before[1], probe.detail)
            state, since, detail = self._state[key]
            error, error_at = self._errors.get(key, ("", None))
        return ServiceHealth(
            key.split(":")[0], state, since, detail, error, error_at, changed=key in self._changed
        )

    def _transition(
        self,
        key: str,
        before: tuple[str, datetime, str] | None,
        probe: Probe,
        now: datetime,
        *,
        db_up: bool,
    ) -> None:
        """Caller holds the lock. Opens an outage row when `key` goes down, closes it when it
        comes back; while the database is down, closing waits for it."""
        if probe.state == DOWN:
            log.warning("%s is down: %s", key, probe.error)
            if db_up:
                self._write(
                    functools.partial(
                        service_outage_open, service=key, started_at=now, error=probe.error
                    )
                )
        elif before is not None and before[0] == DOWN:
            error = self._errors.get(key, ("", now))[0]
            log.warning("%s is back after %.1f s", key, (now - before[1]).total_seconds())
            self._unwritten.append((key, before[1], now, error))
        if db_up:
            for item in list(self._unwritten):
                k, started, ended, err = item
                close = functools.partial(
                    service_outage_close, service=k, started_at=started, ended_at=ended, error=err
                )
                if self._write(close):
                    self._unwritten.remove(item)

    @staticmethod
    def _write(call: Callable[[], object]) -> bool:
        try:
            call()
            return True
        except DatabaseError as exc:  # written on a later probe
            log.warning("could not record an outage: %s", exc)
            return False

    def probes(self) -> dict[str, Probe]:
        """The platform's services, probed at most every PROBE_EVERY_S."""
        with self._lock:
            if time.monotonic() - self._probed_at < PROBE_EVERY_S and self._cache:
                return dict(self._cache)
        fresh = {"redis": probe_redis(), "database": probe_database()}
        if not _per_run():  # else each run has its own router (services)
            fresh["router"], fresh["inference"] = probe_rollout()
        with self._lock:
            self._cache, self._probed_at = fresh, time.monotonic()
        return dict(fresh)

    def services(self, *, run_id: int | None = None, trainer: bool = False) -> list[ServiceHealth]:
        """Every service's health; with `trainer`, also run `run_id`'s trainer."""
        probes = self.probes()
        db_up = probes["database"].state == UP
        rows = [self.observe(key, probe, db_up=db_up) for key, probe in probes.items()]
        if run_id is not None and db_up and (own := _own_router(run_id)):
            router, inference = probe_rollout(own)
            rows.append(self.observe(f"router:{run_id}", router, db_up=db_up))
            rows.append(self.observe(f"inference:{run_id}", inference, db_up=db_up))
        if trainer and run_id is not None:
            probe = probe_trainer(run_id, probes["redis"].state == UP)
            rows.append(self.observe(f"trainer:{run_id}", probe, db_up=db_up))
        return rows


BOARD = HealthBoard()


def _per_run() -> bool:
    try:
        return processes_per_run()
    except DatabaseError:
        return settings.DARTBOARD_PROCESSES == "per-run"


def _own_router(run_id: int) -> str:
    try:
        return run_own_router(run_id=run_id)
    except DatabaseError:  # went down since the probe: the board says so already
        return ""


def outage_banner(rows: list[ServiceHealth]) -> str:
    """One sentence naming what is down and since when; empty when all is well."""
    down = [r for r in rows if r.state == DOWN]
    if not down:
        return ""
    parts = [
        f"{r.label} down since {timezone.localtime(r.since):%H:%M:%S}: {r.last_error}" for r in down
    ]
    return "Outage: " + "; ".join(parts)
