"""Headless chromium for MiniWoB++ inside the sandbox (`envmanager.sandbox`).

Playwright starts the launcher script `browser_launcher` writes in place of the browser
binary; the script runs

    python -m envmanager.sandboxed_browser /usr/bin/chromium <the arguments Playwright gave>

which leases a sandbox uid and a memory/pids cgroup for this browser (`envmanager.sandbox`:
one uid per browser, so one browser's processes never count against another's), gives the
profile directory Playwright made to that uid and execs bubblewrap as that uid, with the
seccomp filter and no user namespaces: no network (loopback only), a clean environment, a
tmpfs home, the profile, the MiniWoB++ task pages read-only and nothing else of the host.
Playwright's pipe to the browser (file descriptors 3 and 4), the uid lease's lock and the
seccomp filter's descriptor pass through the exec (the lease lasts as long as the browser).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from envmanager.sandbox import AGENT_PATH, HOME, bwrap_argv, drop_privileges, with_seccomp
from envmanager.sandbox_limits import (
    SandboxLimits,
    SandboxUnavailable,
    UidLease,
    sandbox_cgroups,
    unlimited_allowed,
)
from envmanager.seccomp import filter_bytes

ROOT = Path(__file__).resolve().parents[1]


def browser_launcher(directory: Path, *, chromium: str, pages: Path) -> Path:
    """Write the executable Playwright is pointed at; returns its path."""
    script = directory / "chromium-sandboxed"
    script.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH="{ROOT}" exec "{sys.executable}" -m envmanager.sandboxed_browser '
        f'"{chromium}" "{pages}" "$@"\n'
    )
    script.chmod(0o755)
    return script


def _give_to(path: Path, uid: int) -> None:
    for parent, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(parent, name), uid, uid)
    os.chown(path, uid, uid)


def main(argv: list[str]) -> None:
    chromium, pages, args = argv[0], argv[1], argv[2:]
    limits = SandboxLimits()
    lease = UidLease()
    os.set_inheritable(lease.fd, True)  # held by bwrap, then the browser, until they end
    try:
        cgroups = sandbox_cgroups(uid=lease.uid, limits=limits)
    except SandboxUnavailable as exc:
        if not unlimited_allowed():
            sys.exit(f"sandboxed browser: {exc}")
        cgroups = []
    binds = []
    for arg in args:
        if arg.startswith("--user-data-dir="):
            profile = arg.split("=", 1)[1]
            _give_to(Path(profile), lease.uid)
            binds.append((profile, profile))
    seccomp = os.memfd_create("dartboard-seccomp", 0)  # inheritable: bwrap reads it after exec
    os.write(seccomp, filter_bytes())
    os.lseek(seccomp, 0, os.SEEK_SET)
    os.set_inheritable(seccomp, True)
    command = bwrap_argv(
        [chromium, *args],
        env={"HOME": HOME, "PATH": AGENT_PATH, "LANG": "C.UTF-8"},
        binds=binds,
        ro_binds=[(pages, pages)],
        chdir=HOME,
        limits=limits,
    )
    drop_privileges(limits, cgroups, uid=lease.uid)
    # An empty environment for bwrap itself too: it stays in the sandbox as its pid 1, whose
    # /proc/1/environ the browser could read.
    os.execve(command[0], with_seccomp(command, seccomp), {})


if __name__ == "__main__":
    main(sys.argv[1:])
