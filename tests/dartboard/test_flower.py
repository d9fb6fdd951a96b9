"""`make flower`: Flower, the Celery monitor, for the stack's broker, never without a login."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.test import Client

from core.procutil import terminate_pid
from tests.helpers import free_port
from tests.private_services import server_log, wait_answering

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


def test_flower_shows_the_brokers_queues_to_an_operator_who_logs_in(subprocess_env):
    port = free_port()
    env = {**subprocess_env, "FLOWER_BASIC_AUTH": "ops:a-long-test-password"}
    with server_log("flower") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "run_flower", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}/flower"
    try:
        wait_answering(f"{url}/healthcheck", proc, what="flower", log=log.name, timeout=180)
        assert httpx.get(f"{url}/", timeout=10).status_code == 401
        assert httpx.get(f"{url}/", auth=("ops", "wrong"), timeout=10).status_code == 401
        page = httpx.get(f"{url}/broker", auth=("ops", "a-long-test-password"), timeout=30)
        assert page.status_code == 200 and "Broker" in page.text
    finally:
        terminate_pid(proc.pid, timeout=10)


def test_flower_is_served_by_the_dashboard_to_admins_only(
    subprocess_env, settings, monkeypatch, viewer_client, ada_client, grace_client
):
    """The shared basic-auth login is gone from the outside: the dashboard serves /flower/
    behind its own login, to the admin role, and passes Flower's login along itself. An
    operator cannot reach Flower's API (which runs any task, slot_serve included)."""
    port = free_port()
    env = {**subprocess_env, "FLOWER_BASIC_AUTH": "ops:a-long-test-password"}
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "ops:a-long-test-password")
    settings.DARTBOARD_FLOWER_URL = f"http://127.0.0.1:{port}"
    with server_log("flower") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "run_flower", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_answering(f"http://127.0.0.1:{port}/flower/healthcheck", proc, what="flower",
                       log=log.name, timeout=180)  # fmt: skip
        assert Client().get("/flower/broker")["Location"].startswith("/accounts/login/?next=")
        apply = "/flower/api/task/async-apply/workers.tasks.ping"
        for someone in (viewer_client, ada_client):
            assert someone.get("/flower/broker").status_code == 403
            assert someone.post(apply, "{}", content_type="application/json").status_code == 403
        page = grace_client.get("/flower/broker")
        assert page.status_code == 200 and b"Broker" in page.content
        assert "Set-Cookie" not in page and "WWW-Authenticate" not in page
        # A page elsewhere cannot make an admin's browser run a task.
        forged = grace_client.post(
            apply, "{}", content_type="application/json", HTTP_ORIGIN="https://evil.example"
        )
        assert forged.status_code == 403
        sent = grace_client.post(
            apply, "{}", content_type="application/json", HTTP_SEC_FETCH_SITE="same-origin"
        )
        assert sent.status_code == 200 and "task-id" in sent.json()
    finally:
        terminate_pid(proc.pid, timeout=10)


def test_the_proxy_sends_nothing_straight_to_flower():
    caddyfile = (ROOT / "deploy" / "Caddyfile").read_text()
    assert "flower:5555" not in caddyfile and "reverse_proxy web:8000" in caddyfile
