"""Hosts for multi-host tests: Linux network namespaces joined by veth pairs to one bridge.

    hosts = VirtualHosts(["svc", "a", "b", "c"])
    hosts.create()            # namespaces, the bridge, a /24 of addresses that exist nowhere else
    hosts.address("a")        # 10.251.k.3
    hosts.argv("a", [...])    # run a command on host a, under its own hostname
    hosts.remove()            # every process left in them ended, every namespace deleted

The bridge lives in a namespace of its own (the "switch"), so no host holds it and no
address of the test exists in the machine's own namespace: traffic goes only between the
namespaces the test made. Each host also gets its own hostname (a UTS namespace per
process), as separate machines have, so what a worker records as its host tells the hosts
apart. Needs root (CI runs as root); `available()` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time

# Namespace names start with this, so a run killed before its clean-up is found by the next.
PREFIX = "dbtest"


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, util-linux)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _end_processes_in(namespace: str) -> None:
    """End what still runs in a namespace this test made (nothing else lives there)."""
    pids = [int(p) for p in _ip("netns", "pids", namespace, check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.1)


def remove_stale() -> list[str]:
    """Delete namespaces left by an earlier run of these tests that was killed (theirs
    only: the name says so, and the process that made them is gone)."""
    removed = []
    for name in _namespaces():
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and os.path.exists(f"/proc/{owner}"):
            continue  # a live test's
        _end_processes_in(name)
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


class VirtualHosts:
    def __init__(self, hosts: list[str]) -> None:
        self.hosts = hosts
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-switch"
        self.subnet = f"10.251.{random.randint(1, 254)}"
        self.created: list[str] = []

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts.index(host) + 2}"

    def hostname(self, host: str) -> str:
        return f"host-{host}"

    def create(self) -> VirtualHosts:
        remove_stale()
        _ip("netns", "add", self.switch)
        self.created.append(self.switch)
        self.exec_in(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self.exec_in(self.switch, "ip", "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.namespace(host)
            _ip("netns", "add", ns)
            self.created.append(ns)
            inside, port = f"{self.tag[-9:]}h{i}", f"{self.tag[-9:]}s{i}"  # <= 15 chars
            _ip("link", "add", inside, "type", "veth", "peer", "name", port)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", port, "netns", self.switch)
            self.exec_in(self.switch, "ip", "link", "set", port, "master", "br0", "up")
            self.exec_in(ns, "ip", "addr", "add", f"{self.address(host)}/24", "dev", inside)
            self.exec_in(ns, "ip", "link", "set", inside, "up")
            self.exec_in(ns, "ip", "link", "set", "lo", "up")
        return self

    def exec_in(self, namespace: str, *argv: str) -> None:
        _ip("netns", "exec", namespace, *argv)

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """`argv` on `host`: in its namespace, under its hostname. The command replaces each
        wrapper in turn (exec), so its pid is the one the caller's Popen returns.

        nsenter joins only the network namespace. `ip netns exec` would also remount /sys
        for it, hiding the cgroup hierarchy: every sandboxed browser on the host would then
        refuse to start without its memory/pids limits, as no real host's would."""
        return [
            "nsenter", f"--net=/run/netns/{self.namespace(host)}",
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(host), *argv,
        ]  # fmt: skip

    def run(
        self, host: str, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 120
    ) -> str:
        """Run a command on `host` to its end; its stdout, or RuntimeError with its stderr."""
        done = subprocess.run(
            self.argv(host, argv), env=env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:4])}... on host {host} exited {done.returncode}: "
                f"{done.stderr[-3000:]}"
            )
        return done.stdout

    def wait_tcp(self, host: str, address: str, port: int, *, timeout: float = 60) -> None:
        """Until something accepts connections at address:port, as seen from `host`."""
        code = (
            "import socket, sys, time\n"
            f"deadline = time.monotonic() + {timeout}\n"
            "while True:\n"
            "    try:\n"
            f"        socket.create_connection(({address!r}, {port}), timeout=1).close()\n"
            "        break\n"
            "    except OSError:\n"
            "        if time.monotonic() > deadline: sys.exit(f'nothing answers at "
            f"{address}:{port}')\n"
            "        time.sleep(0.2)\n"
        )
        self.run(host, [sys.executable, "-c", code], timeout=timeout + 30)

    def remove(self) -> None:
        """End every process left in the namespaces and delete them (the veth pairs and the
        bridge go with them)."""
        for ns in reversed(self.created):
            _end_processes_in(ns)
            _ip("netns", "del", ns, check=False)
        self.created.clear()
