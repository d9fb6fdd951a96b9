"""What a new user meets when the machine is not ready: each start-up problem is one message
that names the fix (a port taken, an old Python, no sudo, too little memory or disk), and
`make` alone lists the targets instead of running apt."""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from core.procutil import pid_cmdline
from hostagent.preflight import Port, disk_problem, memory_problem, port_problem, python_problem
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def _listening(port: int) -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", port))
    held.listen()
    return held


def test_a_taken_port_names_its_process_and_the_option_that_moves_it():
    port = free_port()
    with _listening(port):
        problem = port_problem(Port("127.0.0.1", port, "the dashboard", "--port"))
    assert problem is not None
    assert f"Port {port} on 127.0.0.1, for the dashboard, cannot be used" in problem
    assert f"held by pid {os.getpid()} ({pid_cmdline(os.getpid())})" in problem
    assert "`--port N` (`make run ARGS='--port N'`)" in problem
    assert port_problem(Port("127.0.0.1", port, "the dashboard", "--port")) is None  # freed


@pytest.mark.slow  # a launcher process: Django and the command start in 5-15 s
@pytest.mark.parametrize(
    ("option", "what", "mode"),
    [
        ("--port", "the dashboard", ["--shell-only"]),
        # Per-run processes (the default) take the first free block of ports instead.
        ("--router-port", "the inference router", ["--processes", "shared"]),
    ],
)
def test_the_launcher_refuses_a_taken_port_before_starting_anything(tmp_path, option, what, mode):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"DJANGO_SETTINGS_MODULE": "dartboard.settings", "DARTBOARD_HOME": str(tmp_path)})
    others = ["--port", str(free_port())] if option != "--port" else []
    with _listening(port):
        done = subprocess.run(
            [sys.executable, "manage.py", "run_dartboard", option, str(port), *others, *mode],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"Port {port} on 127.0.0.1, for {what}, cannot be used" in done.stderr
    assert f"`{option} N` (`make run ARGS='{option} N'`)" in done.stderr
    assert "Dartboard is up" not in done.stdout
    assert not (tmp_path / "redis").exists()  # nothing was started


def test_an_old_python_is_named_with_the_fix():
    problem = python_problem((3, 10, 13))
    assert problem is not None and problem.startswith("Dartboard needs Python 3.11 or newer; ")
    assert "this is 3.10.13" in problem and "apt-get install python3.11" in problem
    assert python_problem((3, 11, 2)) is None and python_problem((3, 13, 0)) is None


def test_make_refuses_an_old_python_before_building_the_venv(tmp_path):
    old = sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3.10"))
    if not old:
        pytest.skip("no Python 3.10 on this machine to try")
    venv = tmp_path / "venv"
    done = subprocess.run(
        ["make", "-C", str(ROOT), f"PYTHON={old[0]}", f"VENV={venv}", f"{venv}/bin/python"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and not venv.exists()
    assert "Dartboard needs Python 3.11 or newer" in done.stderr and "Python 3.10" in done.stderr


def test_too_little_memory_or_disk_says_how_much_and_what_to_do(tmp_path):
    memory = memory_problem(need=2**60)
    assert memory is not None and memory.startswith("Only ")
    assert "of memory are available; the main job needs about" in memory
    assert "Stop other programs until `free -h` shows" in memory
    disk = disk_problem(tmp_path, need=2**60)
    assert disk is not None and disk.startswith("Only ") and f"are free under {tmp_path}" in disk
    assert "set DARTBOARD_HOME to a larger disk" in disk
    assert memory_problem(need=1) is None and disk_problem(tmp_path, need=1) is None


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_make_alone_lists_the_targets_and_installs_nothing():
    done = _make()
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Dartboard: make TARGET")
    listed = {line.split()[0] for line in lines[1:] if line.startswith("  ")}
    assert {"run", "test", "test-fast", "run-desktop", "run-vllm", "clean"} <= listed
    assert "apt-get" not in done.stdout + done.stderr


def test_without_root_or_sudo_make_says_what_to_install_and_how_to_skip():
    missing = "dartboard-no-such-package"
    done = _make("system-deps", f"APT_PACKAGES={missing}", "RUN_AS_UID=1000",
                 "SUDO_BIN=/nonexistent/sudo")  # fmt: skip
    assert done.returncode != 0
    assert f"these Debian packages are missing: {missing}" in done.stderr
    assert "this user is not root and has no sudo" in done.stderr
    assert "SKIP_SYSTEM_DEPS=1" in done.stderr
    skipped = _make("system-deps", f"APT_PACKAGES={missing}", "SKIP_SYSTEM_DEPS=1")
    assert skipped.returncode == 0 and "skipping system packages" in skipped.stdout
