"""`make flower`: Flower, the Celery monitor, for the stack's broker, never without a login."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from core.procutil import terminate_pid
from tests.private_services import free_port, server_log, wait_answering

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
        wait_answering(f"{url}/healthcheck", proc, what="flower", log=log.name, timeout=60)
        assert httpx.get(f"{url}/", timeout=10).status_code == 401
        assert httpx.get(f"{url}/", auth=("ops", "wrong"), timeout=10).status_code == 401
        page = httpx.get(f"{url}/broker", auth=("ops", "a-long-test-password"), timeout=30)
        assert page.status_code == 200 and "Broker" in page.text
    finally:
        terminate_pid(proc.pid, timeout=10)
