"""`run_dartboard` brings the stack up, and a killed launcher leaves no stray redis-server."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from core.procutil import pid_cmdline, terminate_pid
from hostagent.launcher import ProcSpec, Stopped, Supervisor, default_specs, stop_on_signals
from rollout.vllm_command import VLLM_PYTHON_ENV, vllm_cpu_build, vllm_missing, vllm_python
from tests.helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _launch(home: Path, port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"DJANGO_SETTINGS_MODULE": "dartboard.settings", "DARTBOARD_HOME": str(home)})
    return subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "run_dartboard",
            "--port",
            str(port),
            "--env-slots",
            "1",
            "--shell-only",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_login_page(port: int, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/accounts/login/", timeout=2) as r:
                return r.read().decode()
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the dashboard did not come up")


def _our_redis_pids(home: Path) -> list[int]:
    sock = str(home / "redis" / "redis.sock")
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            cmd = pid_cmdline(int(entry))
            if cmd and "redis-server" in cmd and sock in cmd:
                pids.append(int(entry))
    return pids


def _all_children_gone(home: Path, pids: list[int], timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _our_redis_pids(home) and all(pid_cmdline(p) is None for p in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_stop_signal_is_not_swallowed_by_a_call_that_handles_its_own_errors():
    """SIGTERM lands wherever the main thread is. In a call that handles its own errors (the
    host agent polling a router: `except Exception`) it must still stop the process."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop_on_signals()
    try:
        with pytest.raises(Stopped, match="SIGTERM"):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises here
            except Exception:
                pass  # what the router poll does with an error
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])


@pytest.mark.slow  # two launchers, each with its web and embedded Redis
def test_sigkill_then_restart_leaves_no_stray_processes(tmp_path):
    port = free_port()
    first = _launch(tmp_path, port)
    try:
        page = _wait_for_login_page(port)
        assert "Log in" in page
        redis_pids = _our_redis_pids(tmp_path)
        assert len(redis_pids) == 1
        first.kill()  # SIGKILL: the launcher gets no chance to clean up
        first.wait()
        # Parent-death signals take the children down; a restart reaps anything left. The
        # old web may answer for a moment after the kill: the page counts once the second
        # launcher's own Redis is up (it starts before the web).
        second = _launch(tmp_path, port)
        try:
            deadline = time.monotonic() + 90
            while not [p for p in _our_redis_pids(tmp_path) if p not in redis_pids]:
                assert second.poll() is None, second.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "the second launcher's Redis did not start"
                time.sleep(0.2)
            _wait_for_login_page(port)
            assert len(_our_redis_pids(tmp_path)) == 1
            assert redis_pids[0] not in _our_redis_pids(tmp_path)
        finally:
            second.send_signal(signal.SIGTERM)
            try:
                out, _ = second.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # it did not stop: end it, then fail
                terminate_pid(second.pid, timeout=5)
                raise
        assert "stopped" in out
        assert "login: admin (password printed at first start" in out
        assert _all_children_gone(tmp_path, redis_pids)
    finally:
        if first.poll() is None:
            terminate_pid(first.pid, timeout=5)


def test_a_vllm_run_starts_vllm_behind_its_adapter_per_worker(settings) -> None:
    specs = default_specs(
        host="127.0.0.1", port=8000, env_slots=1, inference_policy="/models/policy",
        inference_workers=2, backend="vllm",
    )  # fmt: skip
    by_name = {s.name: s for s in specs}
    assert {"vllm-0", "vllm-1", "inference-0", "inference-1", "router"} <= by_name.keys()
    vllm = by_name["vllm-1"]
    assert vllm.env["CUDA_VISIBLE_DEVICES"] == "1" and vllm.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert vllm.argv[0] == str(vllm_python())  # vLLM's own environment, not the project's
    args = vllm.argv[vllm.argv.index("vllm.entrypoints.openai.api_server") + 1 :]
    # Dev mode: a unix socket in DARTBOARD_HOME/run (0700), never a TCP port.
    sock = args[args.index("--uds") + 1]
    assert "--host" not in args and "--port" not in args and "--api-key" not in args
    assert Path(sock).parent == Path(settings.DARTBOARD_HOME) / "run"
    assert vllm.stale == (Path(sock),)  # a dead vLLM's socket would stop the next bind
    adapter_spec = by_name["inference-1"]
    adapter = adapter_spec.argv
    assert adapter[adapter.index("--vllm") + 1] == f"unix:{sock}"
    assert adapter_spec.env["VLLM_API_KEY"] == vllm.env["VLLM_API_KEY"]  # theirs alone
    assert vllm.env["VLLM_API_KEY"] != by_name["vllm-0"].env["VLLM_API_KEY"]
    assert adapter[adapter.index("--policy-dir") + 1] == "/models/policy"
    router = by_name["router"].argv
    worker_port = adapter[adapter.index("--port") + 1]
    assert f"http://127.0.0.1:{worker_port}" in router


def test_vllm_missing_names_the_fix_on_a_host_without_vllm(monkeypatch, tmp_path) -> None:
    # What run_dartboard prints when vLLM's environment was never built.
    monkeypatch.setenv("DARTBOARD_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    message = vllm_missing()
    assert message is not None and "`make vllm-env` builds it" in message
    assert str(tmp_path / "no-venv") in message and "requirements-gpu.txt" in message


@pytest.mark.slow
def test_a_killed_embedded_redis_is_restarted_with_its_data(tmp_path):
    import redis

    port = free_port()
    launcher = _launch(tmp_path, port)
    try:
        _wait_for_login_page(port)
        sock = tmp_path / "redis" / "redis.sock"
        client = redis.Redis(unix_socket_path=str(sock))
        client.set("queued-work", "still here")
        time.sleep(1.5)  # appendfsync everysec: the write is on disk within a second
        (victim,) = _our_redis_pids(tmp_path)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pids = _our_redis_pids(tmp_path)
            if pids and victim not in pids:
                try:
                    if client.get("queued-work") == b"still here":
                        break
                except redis.ConnectionError:
                    pass
            time.sleep(0.2)
        else:
            raise AssertionError("the embedded Redis was not restarted with its data")
        assert (tmp_path / "redis" / "appendonly.aof").stat().st_size > 0
        _wait_for_login_page(port)  # the dashboard is still up
    finally:
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
    assert "embedded Redis exited with -9; restarting it on" in out
    assert _all_children_gone(tmp_path, [])


def test_vllms_cpu_build_runs_eager_and_a_gpu_build_keeps_its_compilation(
    tmp_path, monkeypatch
) -> None:
    """The CPU build would compile its log-prob helper with inductor at the first request of
    every start (docs/benchmarks.md, *vLLM's first request on a CPU*); a GPU build compiles."""

    def vllm_env() -> dict[str, str]:
        specs = default_specs(host="127.0.0.1", port=8000, env_slots=1,
                              inference_policy="/models/policy", backend="vllm")  # fmt: skip
        return next(s for s in specs if s.name == "vllm-0").env

    assert vllm_cpu_build()  # `make vllm-env` built the CPU build here
    assert vllm_env()["TORCHDYNAMO_DISABLE"] == "1"
    gpu_venv = tmp_path / "venv-gpu"
    (gpu_venv / "bin").mkdir(parents=True)
    (gpu_venv / "lib/python3.11/site-packages/vllm-0.32.0.dist-info").mkdir(parents=True)
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(gpu_venv / "bin" / "python"))
    assert not vllm_cpu_build()
    assert "TORCHDYNAMO_DISABLE" not in vllm_env()


def test_a_child_whose_port_another_process_holds_is_named_and_moves_alone(tmp_path):
    """A server that exits because its port is held elsewhere is reported with that port
    (a crash on a free port is not); `respec` starts it on another port and leaves the
    children whose spec did not change running."""

    def server(name: str, port: int) -> ProcSpec:
        argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
        return ProcSpec(name, argv, port=port)

    held, free, other = free_port(), free_port(), free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", held))
    squatter.listen()
    sleeper = ProcSpec("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    group = Supervisor(home=tmp_path, specs=[server("web", held), server("api", free), sleeper])
    try:
        group.start()
        assert wait_until(group.ports_taken, timeout=30, what="web exits") == [("web", held)]
        group.children["api"].proc.kill()  # a crash on a free port: restarted where it was
        group.children["api"].proc.wait()
        assert group.ports_taken() == [("web", held)]
        sleeping = group.children["sleeper"].proc.pid

        started = group.respec([server("web", other), server("api", free), sleeper])
        assert started == ["web"]  # the crashed "api" is the supervisor's to restart
        assert group.children["sleeper"].proc.pid == sleeping
        body = wait_until(lambda: _get(f"http://127.0.0.1:{other}/"), timeout=30, what="web up")
        assert "Directory listing" in body
        assert group.ports_taken() == []
    finally:
        group.stop()
        squatter.close()


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.read().decode()
    except OSError:
        return None
