"""Secrets by need (issue 31): one master token held by the web and the workers, a token per
purpose for everything else, no secret on a command line, in a log or in a file others can
read, each child of the launcher with only the variables it uses, vLLM where only its adapter
connects, and tokens compared as bytes.

Real parts: the launcher's own specs and Supervisor starting a real router, the real desktop
server class on 127.0.0.1, OSWorld's own SetupController, the real router and worker apps.
vLLM is not installed here: a tiny HTTP server on a unix socket stands in for it ONLY to check
the adapter's transport (the unix socket, the key it sends); what vLLM does with `--uds` and
VLLM_API_KEY is from vLLM's documentation and source.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import shutil
import socket
import socketserver
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.conf import settings
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.testclient import TestClient

from hostagent.launcher import ProcSpec, Supervisor, default_specs, prepare_home, wait_http
from rollout.asgi import worker_app
from rollout.auth import (
    ADMIN_ENV,
    INFERENCE_ENV,
    VLLM_KEY_ENV,
    RequestRefused,
    ServiceTokens,
    bearer,
    check_token,
    desktop_purpose,
    purpose_token,
)
from rollout.router import build_app
from rollout.router_state import Router
from tests.helpers import free_port, needs

PLANTED = "planted-secret-5c9e1d"
# What the web and the workers hold and no rollout process may see.
DJANGO_SECRETS = {
    "SECRET_KEY": PLANTED,
    "DATABASE_URL": f"postgres://dartboard:{PLANTED}@127.0.0.1/dartboard",
    "REDIS_URL": f"redis://:{PLANTED}@127.0.0.1:6379/0",
    "AWS_ACCESS_KEY_ID": "writer-key-id",
    "AWS_SECRET_ACCESS_KEY": f"writer-{PLANTED}",
    "DARTBOARD_S3_BUCKET": "dartboard",
}
DJANGO_ONLY = ("SECRET_KEY", "DATABASE_URL", "REDIS_URL", "DARTBOARD_S3_BUCKET")
READ_ONLY = {
    "DARTBOARD_ARTIFACTS_READ_KEY_ID": "reader-key-id",
    "DARTBOARD_ARTIFACTS_READ_SECRET_KEY": "reader-secret-3f1a",
}


def _tokens() -> ServiceTokens:
    return ServiceTokens(settings.DARTBOARD_INFERENCE_TOKEN, settings.DARTBOARD_ADMIN_TOKEN)


def _secret_values(specs: list[ProcSpec]) -> set[str]:
    """Every secret the stack knows: the master, the purpose tokens, the vLLM keys."""
    keys = {s.env[VLLM_KEY_ENV] for s in specs if VLLM_KEY_ENV in s.env}
    tokens = _tokens()
    return {settings.DARTBOARD_SERVICE_TOKEN, tokens.inference, tokens.admin, *keys}


# -- tokens by purpose ------------------------------------------------------------------------


def test_each_purpose_has_its_own_token_and_none_gives_back_the_master() -> None:
    master = settings.DARTBOARD_SERVICE_TOKEN
    purposes = ["inference", "router-admin", "vllm", desktop_purpose("10.0.0.5:5000"),
                desktop_purpose("10.0.0.6:5000")]  # fmt: skip
    tokens = [purpose_token(master, p) for p in purposes]
    assert len(set(tokens)) == len(tokens)  # one desktop's token opens no other
    assert all(master not in t and len(t) == 43 for t in tokens)
    assert tokens == [purpose_token(master, p) for p in purposes]  # workers agree on them
    assert purpose_token("another-master-0123456789", "inference") != tokens[0]
    assert tokens[0] == settings.DARTBOARD_INFERENCE_TOKEN  # the test settings derive them
    assert desktop_purpose(" 10.0.0.5:5000 ") == desktop_purpose("10.0.0.5:5000")
    with pytest.raises(ValueError, match="same"):
        ServiceTokens(inference="x" * 32, admin="x" * 32)


def _router_client() -> tuple[TestClient, ServiceTokens]:
    tokens = _tokens()
    return TestClient(build_app(Router(tokens=tokens, wait_timeout=0.1), tokens=tokens)), tokens


def test_the_routers_admin_routes_refuse_the_inference_token() -> None:
    client, tokens = _router_client()
    admin_calls = [
        ("GET", "/admin/workers", None),
        ("POST", "/admin/workers", {"url": "http://127.0.0.1:9"}),
        ("POST", "/admin/sync", {"checkpoint": "/x", "version": 1}),
        ("GET", "/admin/events", None),
    ]
    for method, path, body in admin_calls:
        for wrong in (tokens.inference, settings.DARTBOARD_SERVICE_TOKEN):
            r = client.request(method, path, json=body, headers=bearer(wrong))
            assert r.status_code == 401, (path, r.text)
    assert client.get("/admin/workers", headers=bearer(tokens.admin)).json() == []
    # ... and the admin token is no inference token: each opens its own routes only.
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/chat/completions", json=chat, headers=bearer(tokens.admin))
    assert r.status_code == 401
    r = client.post("/v1/chat/completions", json=chat, headers=bearer(tokens.inference))
    assert r.status_code == 503  # let in: no worker is registered


def test_a_workers_reload_takes_the_admin_token_and_its_chat_the_inference_token() -> None:
    tokens = _tokens()

    async def ok(_: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    client = TestClient(worker_app((ok, ok, ok, ok), tokens=tokens, threads=(_noop, _noop)))
    reload = {"checkpoint": "/x", "version": 1}
    assert (
        client.post("/v1/reload", json=reload, headers=bearer(tokens.inference)).status_code == 401
    )
    assert client.post("/v1/reload", json=reload, headers=bearer(tokens.admin)).status_code == 200
    assert client.get("/v1/models", headers=bearer(tokens.admin)).status_code == 401
    assert client.get("/v1/models", headers=bearer(tokens.inference)).status_code == 200


def _noop() -> None:
    pass


# -- tokens compared as bytes -----------------------------------------------------------------


@pytest.mark.parametrize(
    "header", ["Bearer tökén-é", b"Bearer \xe9\xe9\xff", "Bearer " + "é" * 43, "bearer \x00"]
)
def test_a_token_that_is_not_ascii_is_a_401_never_an_error(header: str | bytes) -> None:
    with pytest.raises(RequestRefused) as refused:
        check_token(header, _tokens().inference)
    assert refused.value.status == 401


def test_a_server_answers_a_non_ascii_authorization_with_401_not_500() -> None:
    client, tokens = _router_client()
    for path in ("/admin/workers", "/v1/models"):
        r = client.get(path, headers={"Authorization": b"Bearer \xe9t\xe9-\xff"})
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == 401
    assert client.get("/v1/models", headers=bearer(tokens.inference)).status_code == 200


# -- the launcher's children ------------------------------------------------------------------


@pytest.fixture
def planted_environment(monkeypatch, settings) -> None:
    """The launcher's environment as a production host has it: the web's secrets, the
    bucket's write keys and a read-only pair, an s3:// artifact store."""
    for name, value in {**DJANGO_SECRETS, **READ_ONLY}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DARTBOARD_SERVICE_TOKEN", settings.DARTBOARD_SERVICE_TOKEN)
    monkeypatch.setenv("AWS_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    settings.DARTBOARD_ARTIFACTS = "s3://dartboard/artifacts"


def _all_specs() -> list[ProcSpec]:
    common = {"host": "127.0.0.1", "port": 8000, "env_slots": 1, "inference_policy": "/p"}
    return [
        *default_specs(**common, inference_workers=2),
        *[s for s in default_specs(**common, backend="vllm") if s.name.startswith("vllm")],
    ]


def test_no_rollout_child_gets_a_secret_it_does_not_use(planted_environment) -> None:
    specs = _all_specs()
    by_name = {s.name: s for s in specs}
    rollout = [s for s in specs if s.name.startswith(("inference-", "router", "vllm-"))]
    assert {s.name for s in rollout} == {"inference-0", "inference-1", "router", "vllm-0"}
    for spec in rollout:
        assert not spec.inherit, spec.name  # its whole environment is what it is given
        assert not set(spec.env) & set(DJANGO_ONLY), spec.name
        assert PLANTED not in json.dumps(spec.env), spec.name  # the writer's keys included
        assert settings.DARTBOARD_SERVICE_TOKEN not in spec.env.values(), spec.name
        assert "DARTBOARD_SERVICE_TOKEN" not in spec.env, spec.name
    tokens = _tokens()
    for name in ("router", "inference-0"):
        env = by_name[name].env
        assert (env[INFERENCE_ENV], env[ADMIN_ENV]) == (tokens.inference, tokens.admin)
    # Inference workers fetch versions with the read-only pair; the router fetches nothing.
    assert by_name["inference-0"].env["AWS_ACCESS_KEY_ID"] == "reader-key-id"
    assert by_name["inference-0"].env["AWS_SECRET_ACCESS_KEY"] == "reader-secret-3f1a"
    assert not any(k.startswith("AWS_") for k in by_name["router"].env)
    # vLLM holds its key and nothing of Dartboard's.
    vllm = by_name["vllm-0"].env
    assert len(vllm[VLLM_KEY_ENV]) >= 32 and INFERENCE_ENV not in vllm and ADMIN_ENV not in vllm
    assert not any(k.startswith("AWS_") for k in vllm)
    # The web and the Celery workers are configured by the environment: they inherit it.
    assert all(by_name[n].inherit for n in ("web", "worker-env-0", "worker-train", "beat"))


def test_no_secret_is_on_any_childs_command_line(planted_environment) -> None:
    specs = _all_specs()
    secrets_ = _secret_values(specs) | {PLANTED}
    assert len(secrets_) >= 5  # master, inference, admin, a vLLM key, the planted one
    for spec in specs:
        argv = " ".join(spec.argv)
        assert not any(s in argv for s in secrets_), spec.name
    vllm = next(s for s in specs if s.name == "vllm-0")
    assert "--api-key" not in vllm.argv and "--uds" in vllm.argv  # VLLM_API_KEY instead


# -- a real start: files, the running child's environment and command line ------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
@needs("live")
def launched(tmp_path, planted_environment) -> Iterator[tuple[Path, Supervisor, str]]:
    """A DARTBOARD_HOME an older start left readable by everyone, prepared by the launcher,
    and the launcher's router started from it by its Supervisor."""
    home = tmp_path / "home"
    for name in ("logs/web.log", "run/children.json", "dartboard.sqlite3",
                 "dartboard.sqlite3-wal", "secret_key", "service_token"):  # fmt: skip
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text("old")
        (home / name).chmod(0o644)
    for directory in (home, home / "logs", home / "run"):
        directory.chmod(0o755)
    umask = os.umask(0o022)
    try:
        prepare_home(home)
        port = free_port()
        (router,) = [
            s for s in default_specs(host="127.0.0.1", port=0, env_slots=0,
                                     inference_policy="/p", router_port=port)
            if s.name == "router"
        ]  # fmt: skip
        supervisor = Supervisor(home=home, specs=[router])
        supervisor.start()
        try:
            assert wait_http(f"http://127.0.0.1:{port}/health", timeout=60), "no router"
            yield home, supervisor, f"http://127.0.0.1:{port}"
        finally:
            supervisor.stop()
    finally:
        os.umask(umask)


def test_the_launchers_files_are_private_after_a_start(launched) -> None:
    home, supervisor, _ = launched
    assert os.umask(0o077) == 0o077  # prepare_home set it (the fixture puts the old one back)
    for directory in (home, home / "logs", home / "run"):
        assert _mode(directory) == 0o700, directory
    written = [home / "logs" / "router.log", supervisor.pid_file]
    older = [home / n for n in ("logs/web.log", "dartboard.sqlite3", "dartboard.sqlite3-wal",
                                "secret_key", "service_token")]  # fmt: skip
    for path in written + older:
        assert _mode(path) == 0o600, path


def test_the_running_router_holds_its_tokens_and_nothing_else(launched) -> None:
    _, supervisor, router = launched
    pid = supervisor.children["router"].proc.pid
    environ = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        if "=" in item
    )
    assert not set(environ) & {*DJANGO_SECRETS, "DARTBOARD_SERVICE_TOKEN", *READ_ONLY}
    assert "AWS_S3_ENDPOINT_URL" not in environ  # the router fetches nothing from the bucket
    assert PLANTED not in json.dumps(environ)
    tokens = _tokens()
    assert (environ[INFERENCE_ENV], environ[ADMIN_ENV]) == (tokens.inference, tokens.admin)
    secrets_ = {settings.DARTBOARD_SERVICE_TOKEN, tokens.inference, tokens.admin}
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    recorded = supervisor.pid_file.read_text()
    assert "router" in recorded and "rollout.router" in cmdline
    assert not any(s in cmdline or s in recorded for s in secrets_)
    # The started router takes the admin token on /admin/* and refuses the inference token.
    assert httpx.get(f"{router}/admin/workers", headers=bearer(tokens.admin)).status_code == 200
    r = httpx.get(f"{router}/admin/workers", headers=bearer(tokens.inference))
    assert r.status_code == 401


def test_a_running_server_answers_non_ascii_authorization_with_401(launched) -> None:
    _, _, router = launched
    host, port = router.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /admin/workers HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer \xc3\xa9t\xc3\xa9\xff\r\n\r\n")  # fmt: skip
        reply = s.recv(65536).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 401"), reply[:200]


# -- desktops ---------------------------------------------------------------------------------


@pytest.fixture
def desktop() -> Iterator[tuple[str, str]]:
    """The real desktop server class on 127.0.0.1 with the token the workers derive for its
    address (its X desktop is not started: the routes used here need none)."""
    from envmanager.osworld_desktop import OSWorldDesktop
    from envmanager.osworld_server import OSWorldHTTPServer

    port = free_port()
    address = f"127.0.0.1:{port}"
    token = purpose_token(settings.DARTBOARD_SERVICE_TOKEN, desktop_purpose(address))
    desktop = OSWorldDesktop()
    server = OSWorldHTTPServer(("127.0.0.1", port), desktop=desktop, token=token)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield address, token
    finally:
        server.shutdown()
        server.server_close()
        desktop.close()
        shutil.rmtree(desktop._root, ignore_errors=True)  # its unstarted desktop's directory


def test_a_desktop_refuses_another_desktops_token(desktop) -> None:
    address, token = desktop
    master = settings.DARTBOARD_SERVICE_TOKEN
    host, port = address.split(":")
    other = purpose_token(master, desktop_purpose(f"{host}:{int(port) + 1}"))
    for wrong in (other, master, settings.DARTBOARD_INFERENCE_TOKEN):
        r = httpx.get(f"http://{address}/platform", auth=("dartboard", wrong))
        assert r.status_code == 401
    assert httpx.get(f"http://{address}/platform", auth=("dartboard", token)).text == "Linux"


def test_the_osworld_clients_log_lines_carry_no_token(desktop, caplog) -> None:
    from envmanager.osworld_env import OSWorldEnv

    address, token = desktop
    caplog.set_level(logging.DEBUG, logger="desktopenv")
    env = OSWorldEnv(address=address, token=token)
    try:
        # OSWorld's SetupController logs "try to connect http://dartboard:<token>@host:port".
        assert env._setup_controller().setup([]) is True
    finally:
        env.close()
    assert "try to connect http://dartboard:***@127.0.0.1" in caplog.text
    assert token not in caplog.text


# -- vLLM behind its adapter, on a unix socket ------------------------------------------------


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _StandIn(http.server.BaseHTTPRequestHandler):
    """Stands in for vLLM's HTTP ONLY to check the adapter's transport: what reaches the
    unix socket, and with which key."""

    seen: list[tuple[str, str, str | None]] = []

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
        self.seen.append(("GET", self.path, self.headers.get("Authorization")))
        self._answer({"object": "list", "data": [{"id": "policy"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(("POST", self.path, self.headers.get("Authorization")))
        message = {"role": "assistant", "content": "Action: wait()"}
        self._answer({"choices": [{"message": message, "finish_reason": "stop"}]})


def test_the_adapter_reaches_vllm_over_its_unix_socket_with_its_key(tmp_path, tiny_policy_dir):
    from core.imaging import ImageGeometry
    from rollout.vllm_adapter import Adapter

    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    sock = private / "vllm-0.sock"
    server = _UnixHTTPServer(str(sock), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _StandIn.seen = []
    key = "vllm-key-" + "k" * 32
    adapter = Adapter(
        f"unix:{sock}", 3, token=key, geometry=ImageGeometry.from_policy_dir(tiny_policy_dir)
    )
    try:
        adapter.start()
        assert adapter.model == "policy"
        status, reply = adapter.chat({"messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and reply["policy_version"] == 3
        status, _ = adapter.reload(str(tiny_policy_dir), 4)  # full weights: dev-mode routes
        assert status == 200 and adapter.version == 4
    finally:
        adapter.stop()
        server.shutdown()
        server.server_close()
    paths = [path for _, path, _ in _StandIn.seen]
    # It asks vLLM whether the weight-pull extension answers (/collective_rpc) as it starts.
    assert paths[:3] == ["/v1/models", "/collective_rpc", "/v1/chat/completions"]
    assert "/reset_prefix_cache" in paths
    assert {auth for _, _, auth in _StandIn.seen} == {f"Bearer {key}"}
    assert _mode(private) == 0o700  # where the launcher puts the socket: this user only


def test_the_adapter_refuses_a_relative_unix_socket() -> None:
    from rollout.vllm_adapter import vllm_base

    assert vllm_base("http://127.0.0.1:8200/")[0] == "http://127.0.0.1:8200"
    assert vllm_base("unix:/run/x/vllm.sock")[0] == "http://vllm"
    with pytest.raises(ValueError, match="absolute"):
        vllm_base("unix:run/vllm.sock")
