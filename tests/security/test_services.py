"""The rollout service under attack: no token, a wrong token, weights from anywhere, bodies
that lie about their length, seeds and timeouts that broke batches or spun the router.
Real inference server and router processes on 127.0.0.1."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollout.auth import ADMIN_ENV, bearer, client_token
from rollout.client import RouterAdmin
from tests.helpers import free_port, needs
from tests.rollout.test_router import start_process, stop_process

pytestmark = pytest.mark.slow

AUTH = bearer(client_token(None))  # the test settings' inference token
ADMIN = bearer(client_token(None, ADMIN_ENV))  # and their admin token (reloads, /admin/*)
WRONG = bearer("not-the-token-at-all-0123456789")
ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
@needs("live")
def stack(tiny_policy_dir, tmp_path_factory) -> Iterator[tuple[str, str]]:
    """An inference server serving the tiny policy and a router over it."""
    server_port, router_port = free_port(), free_port()
    server, router = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{router_port}"
    procs = [
        start_process(
            ["rollout.server", "--policy", str(tiny_policy_dir), "--port", str(server_port),
             "--threads", "1"],
            health_url=f"{server}/health",
        ),
    ]  # fmt: skip
    try:
        procs.append(
            start_process(
                ["rollout.router", "--port", str(router_port), "--worker", server,
                 "--checkpoint-root", str(tiny_policy_dir.parent)],
                health_url=f"{router}/health",
            )
        )  # fmt: skip
        yield server, router
    finally:
        for proc in procs:
            stop_process(proc)


def error_of(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{}, WRONG], ids=["no token", "wrong token"])
def test_every_route_but_health_needs_the_token(stack, headers) -> None:
    server, router = stack
    admin = RouterAdmin(router)
    before = [w.url for w in admin.workers()]
    attempts = [
        httpx.post(f"{router}/admin/workers", json={"url": "http://127.0.0.1:9"}, headers=headers),
        httpx.request("DELETE", f"{router}/admin/workers", params={"url": server}, headers=headers),
        httpx.post(f"{router}/admin/sync", json={"checkpoint": "/", "version": 9}, headers=headers),
        httpx.get(f"{router}/admin/workers", headers=headers),
        httpx.post(f"{router}/v1/chat/completions", json=CHAT, headers=headers),
        httpx.post(f"{server}/v1/reload", json={"checkpoint": "/", "version": 9}, headers=headers),
        httpx.post(f"{server}/v1/chat/completions", json=CHAT, headers=headers),
        httpx.get(f"{server}/v1/models", headers=headers),
    ]
    for r in attempts:
        assert r.status_code == 401, (r.request.url, r.text)
        assert "wrong token" in error_of(r)
    assert [w.url for w in admin.workers()] == before  # nothing registered or removed
    assert httpx.get(f"{server}/health").json()["policy_version"] == 0
    assert httpx.get(f"{router}/health").status_code == 200  # probes need no token


def test_weights_load_only_from_the_checkpoint_roots(stack, tmp_path, tiny_policy_dir) -> None:
    server, router = stack
    elsewhere = shutil.copytree(tiny_policy_dir, tmp_path / "planted")
    r = httpx.post(
        f"{server}/v1/reload", json={"checkpoint": str(elsewhere), "version": 7}, headers=ADMIN
    )
    assert r.status_code == 403 and "outside the checkpoint roots" in error_of(r)
    link = tiny_policy_dir.parent / "link-out"
    link.symlink_to(elsewhere)
    try:  # a symlink inside a root that leads out of it is resolved first
        r = httpx.post(
            f"{server}/v1/reload", json={"checkpoint": str(link), "version": 7}, headers=ADMIN
        )
        assert r.status_code == 403
    finally:
        link.unlink()
    r = httpx.post(
        f"{router}/admin/sync", json={"checkpoint": str(elsewhere), "version": 7}, headers=ADMIN
    )
    assert r.status_code == 403
    assert httpx.get(f"{server}/health").json()["policy_version"] == 0


def raw_request(url: str, head: str, body: bytes = b"") -> str:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head.encode() + b"\r\n\r\n" + body)
        reply = b""
        while chunk := s.recv(65536):  # the server closes after refusing the body
            reply += chunk
        return reply.decode(errors="replace")


def test_bodies_that_lie_about_their_length_are_refused(stack) -> None:
    server, router = stack
    token = AUTH["Authorization"]
    for url in (server, router):
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {token}"
        reply = raw_request(url, head + "\r\nContent-Length: -5")
        assert reply.startswith("HTTP/1.1 400")  # uvicorn's HTTP parser refuses it unread
        reply = raw_request(url, head + f"\r\nContent-Length: {2**40}")
        assert reply.startswith("HTTP/1.1 413") and "at most" in reply
    assert httpx.get(f"{server}/health").json()["status"] == "ok"


def test_a_seed_past_64_bits_is_one_clients_400(stack) -> None:
    _, router = stack
    r = httpx.post(
        f"{router}/v1/chat/completions", json={**CHAT, "seed": 2**64}, headers=AUTH, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    ok = httpx.post(f"{router}/v1/chat/completions", json=CHAT, headers=AUTH, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "soon"])
def test_the_router_refuses_a_timeout_that_is_not_a_positive_number(stack, value) -> None:
    _, router = stack
    r = httpx.post(
        f"{router}/v1/chat/completions",
        json=CHAT,
        headers={**AUTH, "X-Dartboard-Timeout": value},
        timeout=10,
    )
    assert r.status_code == 400 and "positive number of seconds" in error_of(r)


def test_a_server_without_a_token_refuses_to_start(tiny_policy_dir) -> None:
    for module in ("rollout.server", "rollout.router"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--policy", str(tiny_policy_dir), "--port", "0"]
            if module == "rollout.server"
            else [sys.executable, "-m", module, "--port", "0"],
            cwd=ROOT,
            env={"PATH": "/usr/bin:/bin"},
            capture_output=True,
            timeout=120,
        )
        assert done.returncode != 0
        assert b"no service token: set DARTBOARD_INFERENCE_TOKEN and DARTBOARD_ADMIN_TOKEN" in (
            done.stderr
        )
