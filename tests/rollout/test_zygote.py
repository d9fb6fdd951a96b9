"""Inference servers forked from a zygote serve as `python -m rollout.server` would: each with
its own tokens and streams, its exit status reported, and nothing left when the process that
started them dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rollout import zygote
from rollout.auth import ServiceTokens, bearer
from rollout.local_server import LocalPolicyServer, ServerStartError
from tests.helpers import free_port, needs, wait_until

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "policies" / "tiny-grounded"


@pytest.fixture
@needs("live")
def base_env() -> dict[str, str]:
    """What an inference worker is given besides its tokens (`hostagent.launcher.inference_env`
    has more; these are enough to start one)."""
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}


@pytest.fixture(autouse=True)
def own_zygotes(monkeypatch) -> Iterator[None]:
    """Each test starts from an empty table: the zygotes this xdist worker's earlier tests
    started (up to MAX_ZYGOTES, past which no zygote is started) are not its own. The
    ones it started are closed after it."""
    monkeypatch.setattr(zygote, "_zygotes", {})
    monkeypatch.setattr(zygote, "_failed", set())
    yield
    for started in zygote._zygotes.values():
        started.close()


def _server(port: int) -> list[str]:
    return [
        *(sys.executable, "-m", "rollout.server", "--policy", str(SHIPPED)),
        *("--port", str(port), "--threads", "1"),
    ]


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_two_servers_forked_from_one_zygote_each_take_only_their_own_token(
    base_env, tmp_path
) -> None:
    tokens = [ServiceTokens.fresh(), ServiceTokens.fresh()]
    ports = [free_port(), free_port()]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    # The second differs only in what a forked child sets itself and in a PYTHONPATH that
    # is the working directory: it shares the zygote.
    envs = [
        base_env,
        {"PATH": base_env["PATH"], "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"},
    ]
    procs = []
    try:
        for port, token, log, env in zip(ports, tokens, logs, envs, strict=True):
            with open(log, "ab") as out:
                proc = zygote.start(
                    _server(port), env={**env, **token.environ()}, stdout=out,
                    stderr=subprocess.STDOUT, cwd=ROOT,
                )  # fmt: skip
            assert proc is not None, "started without a zygote"
            procs.append(proc)
        for port in ports:
            wait_until(lambda port=port: _up(port), timeout=120, what=f"the server on {port}")
        parents = {int(_stat(proc.pid)[1]) for proc in procs}
        assert len(parents) == 1, parents  # one zygote for both
        (parent,) = parents
        command = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "-m rollout.zygote" in command
        assert Path(f"/proc/{procs[0].pid}/comm").read_text().strip() == "rollout.server"
        # Each server reads its own tokens from the environment it was given.
        for port, own, other in ((ports[0], *tokens), (ports[1], *reversed(tokens))):
            url = f"http://127.0.0.1:{port}/v1/models"
            assert httpx.get(url, headers=bearer(own.inference)).status_code == 200
            assert httpx.get(url, headers=bearer(other.inference)).status_code == 401
        # The zygote was started without any server's tokens.
        environ = Path(f"/proc/{parent}/environ").read_bytes()
        for token in tokens:
            assert token.inference.encode() not in environ
            assert token.admin.encode() not in environ
        # Each server's output went to its own log.
        for port, log in zip(ports, logs, strict=True):
            assert f"127.0.0.1:{port}" in log.read_text()
        procs[0].kill()
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
        assert procs[1].poll() is None  # its sibling serves on
        assert _up(ports[1])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


CHILD_STREAMS = textwrap.dedent(
    """
    import json, sys
    from rollout import zygote
    zygote._started_as(json.loads(sys.argv[1]))
    print(json.dumps([sys.stdout.write_through, sys.stderr.line_buffering,
                      sys.dont_write_bytecode]))
    """
)


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}, [True, True, True]),
     ({}, [False, True, False])],
)  # fmt: skip
def test_a_forked_child_sets_its_streams_and_bytecode_as_its_own_environment_says(
    env, expected
) -> None:
    """What APPLIED_IN_CHILD names is set in the child as the interpreter would have set it
    at a start under the child's environment, whatever the zygote's was (here the opposite)."""
    opposite = {k: "" if env else "1" for k in ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")}
    out = subprocess.run(
        [sys.executable, "-c", CHILD_STREAMS, json.dumps(env)],
        cwd=ROOT, env={**os.environ, **opposite}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout) == expected


def test_a_server_that_cannot_start_says_why_in_its_log(
    base_env, tiny_policy_dir, tmp_path
) -> None:
    log = tmp_path / "server.log"
    server = LocalPolicyServer(tmp_path / "no-such-policy", log_path=log)
    with pytest.raises(ServerStartError, match=r"exited with [1-9]"):
        server.start(timeout=120)
    assert "no-such-policy" in log.read_text()
    assert isinstance(server.proc, zygote.ZygoteChild) or server.proc is None
    # The same process's next server starts from the same zygote and serves.
    with LocalPolicyServer(tiny_policy_dir) as url:
        assert httpx.get(f"{url}/health").status_code == 200


STARTER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from rollout import zygote
    from rollout.auth import ServiceTokens
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": sys.argv[2], **ServiceTokens.fresh().environ()}
    argv = [sys.executable, "-m", "rollout.server", "--policy", sys.argv[1], "--port", sys.argv[3]]
    proc = zygote.start(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(proc.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_starter_leaves_neither_its_zygote_nor_its_servers(base_env) -> None:
    port = free_port()
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(SHIPPED), str(ROOT), str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        server = int(starter.stdout.readline())  # type: ignore[union-attr]
        wait_until(lambda: _up(port), timeout=120, what="the starter's server")
        parent = int(_stat(server)[1])
        assert int(_stat(parent)[1]) == starter.pid  # the zygote is the starter's child
    finally:
        starter.kill()
        starter.wait()
    wait_until(lambda: not _running(parent) and not _running(server), timeout=30,
               what="the zygote and its server to end with their starter")  # fmt: skip


def _running(pid: int) -> bool:
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_zygote_that_cannot_start_is_said_once_and_servers_start_without_one(
    base_env, tmp_path, caplog, monkeypatch
) -> None:
    env = {**base_env, "PYTHONPATH": str(tmp_path), **ServiceTokens.fresh().environ()}
    argv = _server(free_port())
    # From a directory without the checkout, with no path to it: `rollout.zygote` is not found.
    for _ in range(2):
        assert zygote.start(argv, env=env, stdout=subprocess.DEVNULL, cwd=tmp_path) is None
    said = [r.getMessage() for r in caplog.records if "without a zygote" in r.getMessage()]
    assert len(said) == 1, said
    assert "exited with 1 while importing" in said[0]
    monkeypatch.setenv(zygote.ENABLE_ENV, "0")
    assert zygote.start(argv, env=base_env, cwd=ROOT) is None  # off: nothing is started
