"""An inference worker started with --register joins the router by itself, and joins a
restarted router again (real router and inference server processes)."""

from __future__ import annotations

import pytest

from rollout.client import RouterAdmin
from tests.helpers import free_port, wait_until
from tests.rollout.test_router import start_process, stop_process

pytestmark = pytest.mark.slow


def test_a_worker_registers_itself_and_again_with_a_restarted_router(tiny_policy_dir):
    router_port, worker_port = free_port(), free_port()
    router = f"http://127.0.0.1:{router_port}"
    worker = f"http://127.0.0.1:{worker_port}"
    router_args = ["rollout.router", "--port", str(router_port), "--probe-interval", "0.5"]
    procs = [start_process(router_args, health_url=f"{router}/health")]
    try:
        procs.append(
            start_process(
                [
                    "rollout.server",
                    "--policy",
                    str(tiny_policy_dir),
                    "--port",
                    str(worker_port),
                    "--threads",
                    "1",
                    "--register",
                    router,
                    "--register-every",
                    "1",
                ],
                health_url=f"{worker}/health",
            )
        )
        admin = RouterAdmin(router)
        wait_until(lambda: [(w.url, w.status) for w in admin.workers()] == [(worker, "active")],
                   timeout=30, what="the worker registered and active")  # fmt: skip
        admin.close()

        stop_process(procs.pop(0))  # the router restarts and has forgotten its workers
        procs.insert(0, start_process(router_args, health_url=f"{router}/health"))
        admin = RouterAdmin(router)
        assert [w.url for w in admin.workers()] in ([], [worker])
        wait_until(lambda: [(w.url, w.status) for w in admin.workers()] == [(worker, "active")],
                   timeout=30, what="the worker registered again")  # fmt: skip
        admin.close()
    finally:
        for proc in procs:
            stop_process(proc)
