"""What a desktop's processes can reach, read from the host as root: the window manager runs
in the sandbox with nothing that executes, the display demands its cookie, one sandbox's
fork bomb leaves the others working, the kernel calls a desktop never needs fail, sizes and
outputs are bounded, and a host without cgroups refuses sandboxes unless the admin allows.

Each attack here worked on the code before the containment round (openbox outside the
sandbox as root with Debian's menu; one uid 64999 for every sandbox; no seccomp filter)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import envmanager.sandbox_limits as sandbox_module
from core.protocol import TaskSpec
from envmanager.desktop_env import DesktopEnv
from envmanager.sandbox import Sandbox
from envmanager.sandbox_limits import (
    ALLOW_UNLIMITED_ENV,
    SandboxLimits,
    SandboxUnavailable,
    host_limits_problem,
)
from envmanager.xserver import XServer
from tests.helpers import needs, wait_until

pytestmark = [pytest.mark.desktop]

# The window manager may do these and nothing else (no Execute, ShowMenu, Exit, Restart...).
HARMLESS_ACTIONS = {"Focus", "Raise", "Move", "Resize", "ToggleMaximize", "Close"}


@pytest.fixture
@needs("desktop")
def desktop() -> Iterator[DesktopEnv]:
    env = DesktopEnv(evaluate_wait_s=0.2)
    name = "desktop/xterm-create-file"
    env.reset(TaskSpec(name=name, env_kind="desktop", env_config={"task": name}))
    yield env
    env.close()


@pytest.fixture
@needs("desktop")
def display() -> Iterator[XServer]:
    x = XServer.start(width=320, height=240)
    yield x
    x.stop()


def _sandbox(x: XServer, **limits: int) -> Sandbox:
    root = Path(tempfile.mkdtemp(prefix="dartboard-test-"))
    return Sandbox(
        task_dir=root / "task",
        display=x.display,
        xauth_cookie=x.cookie,
        limits=SandboxLimits(**limits),
    )


def _ns(pid: int, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def test_the_window_manager_runs_in_the_sandbox_with_nothing_that_executes(desktop) -> None:
    assert desktop._x is not None and desktop._x.wm is not None and desktop._jail is not None
    tree = psutil.Process(desktop._x.wm.pid).children(recursive=True)
    (openbox,) = [p for p in tree if p.name() == "openbox"]
    assert openbox.uids().real == desktop._jail.uid
    for kind in ("user", "pid", "net", "mnt"):
        assert _ns(openbox.pid, kind) != _ns(os.getpid(), kind), kind
    environ = Path(f"/proc/{openbox.pid}/environ").read_bytes().split(b"\0")
    assert {e.split(b"=")[0] for e in environ if e} <= {
        b"DISPLAY", b"XAUTHORITY", b"HOME", b"PATH", b"LANG", b"PWD"
    }  # fmt: skip

    # The configuration it runs with, read through its own root: the file on its command line.
    argv = openbox.cmdline()
    config = argv[argv.index("--config-file") + 1]
    seen = f"/proc/{openbox.pid}/root"
    rc = ET.parse(f"{seen}{config}").getroot()
    tag = "{http://openbox.org/3.4/rc}"
    assert list(rc.iter(f"{tag}keybind")) == []
    actions = {a.get("name") for a in rc.iter(f"{tag}action")}
    assert actions and actions <= HARMLESS_ACTIONS, actions - HARMLESS_ACTIONS
    for menu_file in rc.iter(f"{tag}file"):
        menu = ET.parse(f"{seen}{menu_file.text}").getroot()
        assert list(menu) == [], f"the menu file {menu_file.text} has entries"
    # No system configuration (Debian's menu and keybindings) to fall back on.
    assert not os.path.exists(f"{seen}/etc/xdg")


def test_the_display_demands_its_cookie_and_listens_on_no_port(desktop) -> None:
    x = desktop._x
    assert x is not None
    # The platform's X tools: the display, its cookie, PATH and a UTF-8 locale, nothing else.
    assert x.environ() == {"DISPLAY": x.display, "XAUTHORITY": x.environ()["XAUTHORITY"],
                           "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}  # fmt: skip
    without = subprocess.run(
        ["xprop", "-root"], env={"DISPLAY": x.display, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=10,
    )  # fmt: skip
    assert without.returncode != 0 and "Authorization required" in without.stderr
    with_cookie = subprocess.run(
        ["xprop", "-root"], env=x.environ(), capture_output=True, timeout=10
    )
    assert with_cookie.returncode == 0
    tcp = [c for c in psutil.Process(x.xvfb.pid).net_connections(kind="inet")]
    assert tcp == []


def test_each_sandbox_has_its_own_uid_and_gives_it_back(display) -> None:
    first, second = _sandbox(display), _sandbox(display)
    try:
        assert first.uid != second.uid
        ids = [s.run(["id", "-u"], timeout_s=20).stdout.decode().strip() for s in (first, second)]
        assert ids == [str(first.uid), str(second.uid)]
    finally:
        uid = first.uid
        first.close()
        second.close()
    again = [_sandbox(display) for _ in range(2)]
    try:  # the range is searched from the same start: a released uid is leased again
        assert uid in {s.uid for s in again}
    finally:
        for s in again:
            s.close()


FORK_HOLDER = """import os, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    n += 1
open("forked.txt", "w").write(str(n))
time.sleep(60)
"""


def test_a_fork_bomb_in_one_sandbox_leaves_the_others_working(display) -> None:
    bomb, neighbour = _sandbox(display, processes=64), _sandbox(display, processes=64)
    try:
        holder = bomb.popen(["/usr/bin/python3", "-c", FORK_HOLDER])
        deadline = time.monotonic() + 30
        while not (bomb.task_dir / "forked.txt").exists():
            assert time.monotonic() < deadline, "the fork holder never ran out of processes"
            time.sleep(0.1)
        forked = int((bomb.task_dir / "forked.txt").read_text())
        assert 0 < forked <= 64  # its own limit stopped it
        done = neighbour.run(["/bin/sh", "-c", "echo still here"], timeout_s=30)
        assert done.returncode == 0 and done.stdout == b"still here\n", done.stderr
        os.killpg(holder.pid, 9)
        holder.wait()
    finally:
        bomb.close()
        neighbour.close()


ESCAPES = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def tried(name, result):
    print(name, "refused" if result == -1 else "ALLOWED", os.strerror(ctypes.get_errno()))
tried("unshare-user", libc.unshare(0x10000000))
tried("unshare-mount", libc.unshare(0x00020000))
tried("mount", libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
tried("ptrace", libc.ptrace(0, 0, 0, 0))
tried("keyctl", libc.syscall(250, 0, 0, 0, 0, 0))
tried("bpf", libc.syscall(321, 0, 0, 0))
tried("setns", libc.syscall(308, 0, 0))
tried("clone-newuser", libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0))
print(open("/proc/self/status").read().split("Seccomp:")[1].split()[0], "seccomp")
"""


def test_the_sandbox_refuses_namespaces_mounts_ptrace_keys_and_bpf(display) -> None:
    jail = _sandbox(display)
    try:
        out = jail.run(["/usr/bin/python3", "-c", ESCAPES], timeout_s=30).stdout.decode()
        lines = dict(line.split(" ", 1) for line in out.splitlines())
        assert lines.pop("2") == "seccomp"  # mode 2: a filter is installed
        assert len(lines) == 8 and all(v.startswith("refused") for v in lines.values()), out
        nested = jail.run(["unshare", "--user", "--map-root-user", "id"], timeout_s=30)
        assert nested.returncode != 0 and b"Operation not permitted" in nested.stderr
        assert jail.run(["/bin/true"], timeout_s=30).returncode == 0  # ordinary programs run
        # Each layer holds alone: without the seccomp filter, --disable-userns still refuses.
        unfiltered = subprocess.run(
            jail.argv(["unshare", "--user", "--map-root-user", "id"]),
            env={}, capture_output=True, timeout=30, preexec_fn=jail._drop_privileges(),
        )  # fmt: skip
        assert unfiltered.returncode != 0, unfiltered.stdout
    finally:
        jail.close()


def test_tmpfs_mounts_and_the_task_directory_are_sized(display) -> None:
    jail = _sandbox(display, tmp_mb=32, home_mb=16, task_dir_mb=8)
    try:
        df = jail.run(
            ["df", "-B1M", "--output=size,target", "/tmp", "/home/agent", "/home/agent/task"],
            timeout_s=30,
        ).stdout.decode()
        sizes = {line.split()[1]: int(line.split()[0]) for line in df.splitlines()[1:]}
        assert sizes == {"/tmp": 32, "/home/agent": 16, "/home/agent/task": 8}, df
        fill = jail.run(
            ["/bin/sh", "-c", "head -c 20M /dev/zero > /home/agent/task/big"], timeout_s=30
        )
        assert fill.returncode != 0 and b"No space left on device" in fill.stderr
        assert (jail.task_dir / "big").stat().st_size <= 8 * 1024 * 1024
    finally:
        jail.close()


def test_output_read_back_from_a_sandboxed_command_is_capped(display) -> None:
    jail = _sandbox(display)
    try:
        done = jail.run(["yes"], timeout_s=30, max_output_bytes=100_000)
        assert done.truncated and len(done.stdout) == 100_000
        # Stopped at the cap, not left writing until its timeout or the sandbox's close.
        wait_until(lambda: not _running_as(jail.uid), timeout=10, what="`yes` to be gone")
        short = jail.run(["echo", "hi"], timeout_s=30, max_output_bytes=100_000)
        assert not short.truncated and short.stdout == b"hi\n"
        with pytest.raises(subprocess.TimeoutExpired):
            jail.run(["/bin/sh", "-c", "sleep 1000 & sleep 1000"], timeout_s=1)
        wait_until(lambda: not _running_as(jail.uid), timeout=10, what="the sleeps to be gone")
    finally:
        jail.close()


def _running_as(uid: int) -> list[str]:
    """What still runs under `uid` (zombies aside)."""
    running = []
    for proc in psutil.process_iter(["uids", "status", "name"]):
        if proc.info["uids"] and proc.info["uids"].real == uid and proc.info["status"] != "zombie":
            running.append(proc.info["name"])
    return running


def test_without_a_cgroup_a_sandbox_refuses_unless_the_admin_allows(
    display, monkeypatch, tmp_path
) -> None:
    not_a_hierarchy = tmp_path / "cgroup"
    not_a_hierarchy.write_text("")  # mkdir beneath a file fails, as on a read-only cgroupfs
    monkeypatch.setattr(sandbox_module, "CGROUP_ROOT", not_a_hierarchy)
    monkeypatch.delenv(ALLOW_UNLIMITED_ENV, raising=False)
    with pytest.raises(
        SandboxUnavailable, match=f"cannot create the memory/pids cgroup.*{ALLOW_UNLIMITED_ENV}=1"
    ):
        _sandbox(display)
    monkeypatch.setenv(ALLOW_UNLIMITED_ENV, "1")
    jail = _sandbox(display)
    try:
        assert jail.unlimited and "cgroup" in jail.unlimited
        assert jail.run(["/bin/true"], timeout_s=30).returncode == 0
    finally:
        jail.close()
    assert "cannot create the memory/pids cgroup" in (host_limits_problem() or "")


@pytest.mark.django_db
def test_the_host_map_says_when_a_host_runs_sandboxes_without_limits(ada_client) -> None:
    from datamanager.models import EnvSlot
    from tests.datamanager.factories import make_running_run, make_tasks

    make_tasks(1)
    run = make_running_run({"env": {"desktop_slots": 2}})
    EnvSlot.objects.create(name="lab-3:1:desktop:0", host="lab-3", backend="desktop", run=run,
                           sandbox_note="cannot create the memory/pids cgroup /sys/fs/cgroup/x")  # fmt: skip
    EnvSlot.objects.create(name="lab-4:1:desktop:1", host="lab-4", backend="desktop", run=run)
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    tiles = {
        m.group(1): m.group(0)
        for m in re.finditer(r'<div class="host \w+" data-host="([\w-]+)".*?</div>', page, re.S)
    }
    assert "sandbox limits not enforced" in tiles["lab-3"]
    assert "cannot create the memory/pids cgroup" in tiles["lab-3"]
    assert "sandbox limits not enforced" not in tiles["lab-4"]
