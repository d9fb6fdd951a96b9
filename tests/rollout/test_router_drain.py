"""The router drains a worker that cannot swap live before reloading it: the vLLM adapter,
whose full-weight reload waits for its requests, in front of a stand-in for vLLM's HTTP."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from core.weight_wire import WeightSource
from rollout.client import RouterAdmin, WorkerStatus
from tests.helpers import free_port, needs, wait_until
from tests.rollout.test_router import ADMIN, start_process, stop_process

pytestmark = pytest.mark.slow


class _StandIn(http.server.BaseHTTPRequestHandler):
    """Stands in for vLLM's HTTP ONLY so the adapter can start and reload: every route
    answers 200; the paths and bodies posted are kept."""

    posted: list[tuple[str, dict[str, Any]]] = []

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the stdlib's name)
        pass

    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": [{"id": "policy"}]})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.posted.append((self.path, json.loads(raw or b"{}")))
        self._answer({})


@pytest.fixture
@needs("live")
def adapter_and_router(checkpoints) -> Iterator[tuple[str, str]]:
    vllm = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=vllm.serve_forever, daemon=True).start()
    _StandIn.posted = []
    adapter_port, router_port = free_port(), free_port()
    adapter, router = f"http://127.0.0.1:{adapter_port}", f"http://127.0.0.1:{router_port}"
    procs = []
    try:
        procs.append(
            start_process(
                [
                    "rollout.vllm_adapter",
                    "--vllm",
                    f"http://127.0.0.1:{vllm.server_port}",
                    "--policy-dir",
                    str(checkpoints[0]),
                    "--port",
                    str(adapter_port),
                    "--checkpoint-root",
                    str(checkpoints[0].parent),
                ],
                health_url=f"{adapter}/health",
            )
        )
        procs.append(
            start_process(
                [
                    "rollout.router",
                    "--port",
                    str(router_port),
                    "--probe-interval",
                    "0.5",
                    "--worker",
                    adapter,
                ],
                health_url=f"{router}/health",
            )
        )
        yield adapter, router
    finally:
        for proc in procs:
            stop_process(proc)
        vllm.shutdown()
        vllm.server_close()


def test_a_worker_that_cannot_swap_live_is_drained_and_loads_the_checkpoint(
    adapter_and_router, checkpoints
):
    adapter, router = adapter_and_router
    admin = RouterAdmin(router)
    wait_until(lambda: [w.status for w in admin.workers()] == ["active"], what="adapter active")
    health = httpx.get(f"{adapter}/health").json()
    # A vLLM started without the weight-pull extension (the stand-in has none).
    assert "swaps_live" not in health and health["pulls_weights"] is False
    # The trainer runs a weight server, but this worker does not pull: it gets the checkpoint.
    elsewhere = WeightSource("127.0.0.1", free_port(), 1, "0" * 32, "k" * 43)
    admin.sync(str(checkpoints[1]), 1, weights=elsewhere)
    admin.wait_for_version(1, timeout=60)
    events = httpx.get(f"{router}/admin/events", headers=ADMIN).json()
    order = [e["status"] for e in events if e["worker"] == adapter]
    assert order[-3:] == [WorkerStatus.DRAINING, WorkerStatus.LOADING, WorkerStatus.ACTIVE]
    loading = next(e for e in events if e["status"] == WorkerStatus.LOADING)
    assert loading["detail"] == f"v1 from {checkpoints[1]}"
    rpc = [body for path, body in _StandIn.posted if path == "/collective_rpc"]
    assert rpc == [
        {"method": "dartboard_pulls", "kwargs": {}},  # the adapter asks whether vLLM pulls
        {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoints[1])}},
    ]
    admin.close()


def test_a_loopback_weight_server_serves_only_workers_on_its_host() -> None:
    from rollout.router_state import weight_server_reaches

    assert weight_server_reaches("127.0.0.1", "http://127.0.0.1:8101")
    assert weight_server_reaches("10.0.0.2", "http://10.0.0.5:8101")
    # A worker on another host would connect to its own loopback and wait out the timeout.
    assert not weight_server_reaches("127.0.0.1", "http://10.0.0.5:8101")
    assert not weight_server_reaches("localhost", "http://gpu-2:8101")
