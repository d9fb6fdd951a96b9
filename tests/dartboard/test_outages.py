"""Redis and the database die under a live run: the run goes on, the page says what was
down while it was, and nothing is lost.

The stack is `make run`'s (tests/live_stack.py) with its own Redis and, for the database
test, its own PostgreSQL cluster, so the test can kill and restart them:
1. the embedded Redis is SIGKILLed, and the launcher's supervisor restarts it on the same
   socket with its append-only file;
2. the same Redis is stopped for 10 s and started again without its data, as a Redis server
   run without persistence comes back (every queue, lease and marker gone);
3. PostgreSQL is stopped (fast shutdown: open connections cut) for 20 s and started again.
Each asserts that trajectories keep being recorded (and, at the end, that a trainer update
follows), that
every trajectory finished before is unchanged, that no step was trained twice, that no slot
was served by two workers at once, and that the run's health line showed the outage.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import dj_database_url
import pytest
from django.core.management import call_command
from django.db import connections
from django.db.utils import load_backend
from django.test import Client
from django.utils import timezone

from dartboard.embedded_redis import EmbeddedRedis
from datamanager.models import Run, ServiceOutage, TrainUpdate, Trajectory
from tests.live_stack import (
    create_started_run,
    finished,
    finished_after,
    live_stack,
    slots_served_twice,
    trained_twice,
)
from tests.private_services import PrivatePostgres

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start_workers(run: Run, env: dict[str, str]) -> None:
    """Enqueue the run's tasks from a process of the stack's own configuration (its Redis)."""
    code = f"from workers.runs import run_start_workers; run_start_workers(run_id={run.pk})"
    subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip


def _health(client: Client, run: Run) -> dict[str, dict]:
    response = client.get(f"/runs/{run.pk}/health.json", HTTP_ACCEPT="application/json")
    body = response.json()
    return {"_banner": body.get("banner", ""), **{s["service"]: s for s in body["services"]}}


def _going_on(stack, run: Run, since, *, what: str, episodes: int = 2, update: bool) -> None:
    """Episodes that started after `since` finish (and, with `update`, a trainer update
    follows)."""
    updates = TrainUpdate.objects.filter(run=run).count()
    stack.wait(lambda: len(finished_after(run, since)) >= episodes, timeout=180,
               what=f"{episodes} episodes started after {what}")  # fmt: skip
    if update:
        stack.wait(lambda: TrainUpdate.objects.filter(run=run).count() > updates, timeout=180,
                   what=f"a trainer update after {what}")  # fmt: skip


def _under_way(stack, run: Run) -> None:
    """The run has finished episodes and has one under way: something to carry through."""
    stack.wait(lambda: len(finished(run)) >= 2 and _running(run), timeout=300,
               what="2 finished episodes and one under way")  # fmt: skip


def _running(run: Run) -> list[int]:
    return list(Trajectory.objects.filter(run=run, status="running").values_list("pk", flat=True))


def _nothing_lost(run: Run, before: dict, in_flight: list[int]) -> None:
    """Finished trajectories unchanged, the episodes under way when it broke finished as
    policy outcomes (not lost as errors), no step trained twice, no slot on two workers."""
    after = finished(run)
    assert {pk: after.get(pk) for pk in before} == before
    ended = dict(Trajectory.objects.filter(pk__in=in_flight).values_list("pk", "status"))
    assert all(status in ("succeeded", "failed", "running") for status in ended.values()), ended
    assert trained_twice(run) == 0
    assert slots_served_twice(run) == []


@pytest.fixture(autouse=True)
def _probe_every_request(monkeypatch):
    """The web probes at most every 2 s; here each request probes, so a poll right after a
    kill sees it."""
    from dartboard.health import HealthBoard

    monkeypatch.setattr("dartboard.health.PROBE_EVERY_S", 0.0)
    monkeypatch.setattr("dartboard.health.BOARD", HealthBoard())  # no state from other tests


@pytest.fixture
def health_client(researcher) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(researcher)
    return client


def test_redis_killed_then_restarted_without_its_data_the_run_goes_on(
    subprocess_env, settings, tmp_path, health_client
):
    redis = EmbeddedRedis(tmp_path / "redis" / "redis.sock")
    env = {**subprocess_env, "REDIS_URL": redis.url}
    settings.REDIS_URL = redis.url  # this process's health probes and lease reads
    with live_stack(env, tmp_path, redis=redis) as stack:
        settings.DARTBOARD_INFERENCE_URLS = [stack.router]
        run = create_started_run("redis outage")
        _start_workers(run, env)
        _under_way(stack, run)
        assert _health(health_client, run)["redis"]["state"] == "up"

        # 1. SIGKILL: the page says Redis is down until the supervisor restarts it.
        before, in_flight = finished(run), _running(run)
        assert redis.proc is not None
        os.kill(redis.proc.pid, signal.SIGKILL)
        redis.proc.wait(timeout=10)
        seen = _health(health_client, run)
        assert seen["redis"]["state"] == "down" and "Redis down since" in seen["_banner"]
        assert "Connection" in seen["redis"]["last_error"] or "Error" in seen["redis"]["last_error"]
        stack.supervisor.watch_once()  # the launcher's loop: restarted on the same socket
        back = timezone.now()
        stack.wait(lambda: _health(health_client, run)["redis"]["state"] == "up", timeout=30,
                   what="Redis up again on the page")  # fmt: skip
        _going_on(stack, run, back, what="the embedded Redis was killed", episodes=1, update=False)
        _nothing_lost(run, before, in_flight)

        # 2. Stopped for 10 s, back empty: every queued task, lease and marker is gone.
        before, in_flight = finished(run), _running(run)
        redis.stop()
        for leftover in redis.dir.glob("appendonly*"):
            if leftover.is_dir():
                for f in leftover.iterdir():
                    f.unlink()
            else:
                leftover.unlink()
        stack.supervisor.redis = None  # an operator's server: nobody restarts it for us
        down_seen = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = _health(health_client, run)
            down_seen += seen["redis"]["state"] == "down" and "Redis down" in seen["_banner"]
            stack.supervisor.watch_once()
            time.sleep(2.5)
        assert down_seen >= 3
        redis.persist = False
        redis.start()
        stack.supervisor.redis = redis
        back = timezone.now()
        _going_on(stack, run, back, what="Redis came back without its data", update=True)
        _nothing_lost(run, before, in_flight)
        assert _health(health_client, run)["trainer"]["state"] == "up"

    outages = list(ServiceOutage.objects.filter(service="redis").order_by("started_at"))
    assert len(outages) >= 2 and all(o.ended_at is not None for o in outages[:2])
    assert outages[1].duration_s is not None and outages[1].duration_s >= 8


@contextlib.contextmanager
def _django_on(url: str) -> Iterator[None]:
    """This thread's default database connection on `url` for the block (the test reads
    and serves what the stack writes there); the suite's connection is put back after."""
    original = connections["default"]
    parsed = dj_database_url.parse(url)
    settings_dict = {**original.settings_dict, **parsed, "OPTIONS": {}, "CONN_MAX_AGE": 0,
                     "CONN_HEALTH_CHECKS": True}  # fmt: skip
    wrapper = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, "default")
    connections["default"] = wrapper
    try:
        yield
    finally:
        wrapper.close()
        connections["default"] = original


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    cluster = PrivatePostgres().init()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.remove()


def test_postgres_restarted_mid_run_the_run_goes_on(
    subprocess_env, settings, tmp_path, live_work_keys_cleared, private_postgres, django_user_model
):
    url = private_postgres.create_database("dartboard_outage")
    env = {**subprocess_env, "DATABASE_URL": url}
    with _django_on(url):
        call_command("migrate", verbosity=0)
        client = Client(raise_request_exception=False)
        client.force_login(django_user_model.objects.create_superuser("ops", password="x-1234567"))
        with live_stack(env, tmp_path) as stack:
            settings.DARTBOARD_INFERENCE_URLS = [stack.router]
            run = create_started_run("database outage")
            _start_workers(run, env)
            _under_way(stack, run)
            in_flight = stack.wait(lambda: _running(run), timeout=60, what="an episode under way")
            before = finished(run)
            private_postgres.stop()
            stopped = time.monotonic()
            seen = []
            while time.monotonic() - stopped < 20:
                response = client.get(f"/runs/{run.pk}/health.json")
                seen.append((response.status_code, response.json()))
                page = client.get(f"/runs/{run.pk}/")
                assert page.status_code == 503 and b"cannot reach its database" in page.content
                stack.supervisor.watch_once()
                time.sleep(3)
            private_postgres.start()
            connections["default"].close()  # this test's own connection died with the server
            back = timezone.now()
            # Every answer during the outage was a 503 naming the database.
            assert seen and all(code == 503 for code, _ in seen)
            assert all("the database is unreachable" in body["outage"] for _, body in seen)
            states = {s["service"]: s["state"] for s in seen[-1][1]["services"]}
            assert states["database"] == "down" and states["redis"] == "up"

            _going_on(stack, run, back, what="PostgreSQL restarted", update=True)
            _nothing_lost(run, before, in_flight)
            assert client.get(f"/runs/{run.pk}/").status_code == 200
            outage = ServiceOutage.objects.get(service="database")
            assert outage.ended_at is not None and outage.duration_s >= 15
