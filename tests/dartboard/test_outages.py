"""The database restarts under a live run: the run goes on, the page says the database was
down while it was, and nothing is lost.

The stack is `make run`'s (tests/live_stack.py) on its own PostgreSQL cluster (initdb and
pg_ctl on a free port), stopped with a fast shutdown (open connections cut) for 20 s and
started again. The test asserts that episodes and a trainer update follow, that every
trajectory finished before is unchanged, that the episodes under way finished as outcomes,
that no step was trained twice, that no slot was served by two workers at once, and that
every page and the health JSON answered 503 naming the database while it was down.
Redis outages (SIGKILLed, and back without its data) are the last part of
tests/dartboard/test_fault_tolerance.py, on the suite's own database.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import dj_database_url
import pytest
from django.core.management import call_command
from django.db import connections
from django.db.utils import load_backend
from django.test import Client
from django.utils import timezone

from datamanager.models import ServiceOutage
from tests.helpers import needs
from tests.live_stack import (
    create_started_run,
    finished,
    going_on,
    live_stack,
    nothing_lost,
    running,
    start_workers,
    under_way,
)
from tests.private_services import PrivatePostgres

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _probe_every_request(monkeypatch):
    """The web probes at most every 2 s; here each request probes, so a poll right after a
    stop sees it."""
    from dartboard.health import HealthBoard

    monkeypatch.setattr("dartboard.health.PROBE_EVERY_S", 0.0)
    monkeypatch.setattr("dartboard.health.BOARD", HealthBoard())  # no state from other tests


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
@needs("live")
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
            start_workers(run, stack)
            under_way(stack, run)
            in_flight = stack.wait(lambda: running(run), timeout=60, what="an episode under way")
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

            going_on(stack, run, back, what="PostgreSQL restarted", update=True)
            nothing_lost(run, before, in_flight)
            assert client.get(f"/runs/{run.pk}/").status_code == 200
            outage = ServiceOutage.objects.get(service="database")
            assert outage.ended_at is not None and outage.duration_s >= 15
