"""A policy typing into a live desktop's shell tries to reach the worker's secrets, files and
network, and to trick the checker: each attempt is refused and the desktop keeps working.

The actions are what a model's text becomes (structured `Action`s through `DesktopEnv.step`),
on a real Xvfb desktop with a real xterm + bash in the real bubblewrap sandbox.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.protocol import Action, ActionType, TaskSpec
from envmanager.desktop_env import DesktopEnv
from envmanager.desktop_tasks import read_task_file
from envmanager.sandbox_limits import AGENT_UID_BASE, AGENT_UID_COUNT
from tests.helpers import needs, wait_until

pytestmark = [pytest.mark.desktop, pytest.mark.slow]

SECRET = "dartboard-test-secret-7f3a9c"
CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.fixture
@needs("desktop")
def shell(monkeypatch, tmp_path) -> Iterator[DesktopEnv]:
    """A desktop on the xterm task, in a worker whose environment holds secrets."""
    monkeypatch.setenv("SECRET_KEY", SECRET)
    monkeypatch.setenv("DATABASE_URL", f"postgres://dartboard:{SECRET}@127.0.0.1/dartboard")
    monkeypatch.setenv("DARTBOARD_HOME", str(tmp_path))
    (tmp_path / "secret_key").write_text(SECRET)
    env = DesktopEnv(evaluate_wait_s=0.5)
    name = "desktop/xterm-create-file"
    env.reset(TaskSpec(name=name, env_kind="desktop", env_config={"task": name}))
    env.step(Action(type=ActionType.CLICK, x=300, y=200))  # focus the terminal
    yield env
    env.close()


def type_command(env: DesktopEnv, command: str, *, wait_for: str, timeout_s: float = 15) -> str:
    """Type `command` + Enter into the shell; return the task file `wait_for` it writes."""
    env.step(Action(type=ActionType.TYPE, text=command + "\n"))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = read_task_file(env._sandbox, wait_for)
        if text is not None and text.endswith("END\n"):
            return text
        time.sleep(0.1)
    raise AssertionError(f"the shell did not write {wait_for}: did the command run?")


def test_the_shell_sees_no_secret_of_the_worker(shell: DesktopEnv, tmp_path) -> None:
    out = type_command(shell, "env > env.txt; echo END >> env.txt", wait_for="env.txt")
    names = {line.split("=", 1)[0] for line in out.splitlines() if "=" in line}
    assert SECRET not in out
    assert names <= {"DISPLAY", "XAUTHORITY", "HOME", "PATH", "LANG", "PWD", "OLDPWD", "SHLVL", "_", "TERM",
                     "WINDOWID", "XTERM_VERSION", "XTERM_SHELL", "XTERM_LOCALE", "COLUMNS",
                     "LINES"}  # fmt: skip
    out = type_command(
        shell,
        f"cat {tmp_path}/secret_key {CHECKOUT}/README.md /proc/1/environ > files.txt 2>&1; "
        f"ls -a / >> files.txt; id -u >> files.txt; echo END >> files.txt",
        wait_for="files.txt",
    )
    assert SECRET not in out and "# Dartboard" not in out
    assert f"{tmp_path}/secret_key: No such file or directory" in out
    assert f"{CHECKOUT}/README.md: No such file or directory" in out
    assert "work" not in out.split() and "root" not in out.split()
    assert str(shell._jail.uid) in out.split()  # the desktop's own uid, not root


def test_the_shell_cannot_reach_a_server_on_this_host(shell: DesktopEnv) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        out = type_command(
            shell,
            f"(exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED) > net.txt 2>&1; "
            "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' >> net.txt; echo END >> net.txt",
            wait_for="net.txt",
        )
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert "CONNECTED" not in out and "Connection refused" in out
    # Its network namespace has a loopback device and nothing else: no route anywhere.
    assert out.splitlines()[-2] == "lo"
    assert accepted == []


def test_symlinks_and_huge_files_do_not_fool_or_exhaust_the_checker(shell: DesktopEnv) -> None:
    type_command(
        shell,
        "ln -s /etc/hostname done.txt; echo END > links.txt",
        wait_for="links.txt",
    )
    verdict = shell.evaluate()
    assert verdict.reward == 0.0
    assert "symlink" in verdict.details["reason"]
    assert "content" not in verdict.details  # nothing behind the link was read
    out = type_command(
        shell,
        "rm done.txt; mkfifo done.txt; head -c 100M /dev/zero > big.bin 2> size.txt; "
        "stat -c %s big.bin >> size.txt; echo END >> size.txt",
        wait_for="size.txt",
    )
    assert out.split()[-2] == "67108864"  # big.bin stopped at the sandbox's 64 MiB limit
    verdict = shell.evaluate()
    assert verdict.reward == 0.0 and "not a regular file" in verdict.details["reason"]
    # The desktop still works: the task can be solved after all that.
    type_command(shell, "rm done.txt; echo ok > done.txt; echo END > fin.txt", wait_for="fin.txt")
    assert shell.evaluate().reward == 1.0


def test_a_killed_sandbox_leaves_no_process_of_the_agent_behind() -> None:
    env = DesktopEnv(evaluate_wait_s=0.5)
    name = "desktop/xterm-create-file"
    env.reset(TaskSpec(name=name, env_kind="desktop", env_config={"task": name}))
    env.step(Action(type=ActionType.CLICK, x=300, y=200))
    env.step(Action(type=ActionType.TYPE, text="sleep 1000 &\n"))
    # The sleep must have started, or its absence afterwards proves nothing.
    started = wait_until(_agents_sleeps, timeout=15, what="the typed `sleep 1000 &` to start")
    assert env._jail is not None and all(_uid(pid) == env._jail.uid for pid in started)
    env.close()
    wait_until(lambda: not _agents_sleeps(), timeout=5, what="the agent's sleep to end")


def _agents_sleeps() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit() and _is_agents_sleep(p)]


def _uid(pid: str) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return -1
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def _is_agents_sleep(pid: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    in_range = AGENT_UID_BASE <= _uid(pid) < AGENT_UID_BASE + AGENT_UID_COUNT
    return in_range and cmdline.startswith(b"sleep\x001000")
