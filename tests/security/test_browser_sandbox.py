"""The MiniWoB++ chromium runs in the sandbox: not as the worker's user, without the worker's
environment, in a network namespace of its own, seeing none of the host's files."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from core.protocol import TaskSpec
from envmanager.miniwob_env import MiniWoBEnv, miniwob_html_dir
from envmanager.sandbox_limits import AGENT_UID_BASE, AGENT_UID_COUNT

pytestmark = pytest.mark.browser
CHECKOUT = Path(__file__).resolve().parents[2]


def test_the_miniwob_browser_is_sandboxed(monkeypatch) -> None:
    monkeypatch.setenv("SECRET_KEY", "dartboard-test-secret-in-the-worker")
    env = MiniWoBEnv()
    try:
        env.reset(TaskSpec(name="miniwob/click-test", env_kind="miniwob",
                           env_config={"task": "click-test"}, seed=3))  # fmt: skip
        tree = psutil.Process(env.browser_pid()).children(recursive=True)
        renderers = [p for p in tree if "chromium" in " ".join(p.cmdline())]
        assert renderers, "no chromium process under the sandbox"
        own_net = os.readlink("/proc/self/ns/net")
        for proc in renderers:
            pid = proc.pid
            assert AGENT_UID_BASE <= proc.uids().real < AGENT_UID_BASE + AGENT_UID_COUNT
            with open(f"/proc/{pid}/environ", "rb") as f:  # bwrap's own too: it is pid 1 there
                environ = f.read()
            assert b"dartboard-test-secret" not in environ and b"DATABASE_URL" not in environ
            assert os.readlink(f"/proc/{pid}/ns/net") != own_net
            # Of the host's files it sees the task pages (read-only) and nothing else: not the
            # checkout, its virtual environment or the worker's home.
            seen = f"/proc/{pid}/root"
            for hidden in (CHECKOUT / "README.md", CHECKOUT / ".venv" / "bin", Path.home()):
                assert not os.path.exists(f"{seen}{hidden}"), hidden
            assert os.path.exists(f"{seen}{miniwob_html_dir()}/click-test.html")
        # Playwright's driver runs outside the sandbox: an allow-listed environment.
        drivers = [p for p in psutil.Process().children(recursive=True)
                   if "run-driver" in " ".join(p.cmdline())]  # fmt: skip
        assert drivers, "no Playwright driver process found"
        for proc in drivers:
            environ = proc.environ()
            assert "SECRET_KEY" not in environ and "PATH" in environ, sorted(environ)
    finally:
        env.close()
