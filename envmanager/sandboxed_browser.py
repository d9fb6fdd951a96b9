"""Headless chromium for MiniWoB++ inside the sandbox (`envmanager.sandbox`).

Playwright starts the launcher script `browser_launcher` writes in place of the browser
binary; the script runs

    python -m envmanager.sandboxed_browser /usr/bin/chromium <the arguments Playwright gave>

which gives the profile directory Playwright made to the agent uid and execs bubblewrap as
that uid: no network (loopback only), a clean environment, a tmpfs home, the profile, the
MiniWoB++ task pages read-only and nothing else of the host. Playwright's pipe to the browser
(file descriptors 3 and 4) passes through the exec.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from envmanager.sandbox import (
    AGENT_GID,
    AGENT_PATH,
    AGENT_UID,
    HOME,
    SandboxLimits,
    bwrap_argv,
    drop_privileges,
)

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


def _give_to_agent(path: Path) -> None:
    for parent, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(parent, name), AGENT_UID, AGENT_GID)
    os.chown(path, AGENT_UID, AGENT_GID)


def main(argv: list[str]) -> None:
    chromium, pages, args = argv[0], argv[1], argv[2:]
    binds = []
    for arg in args:
        if arg.startswith("--user-data-dir="):
            profile = arg.split("=", 1)[1]
            _give_to_agent(Path(profile))
            binds.append((profile, profile))
    command = bwrap_argv(
        [chromium, *args],
        env={"HOME": HOME, "PATH": AGENT_PATH, "LANG": "C.UTF-8"},
        binds=binds,
        ro_binds=[(pages, pages)],
        chdir=HOME,
    )
    drop_privileges(SandboxLimits(), cgroups=[])
    # An empty environment for bwrap itself too: it stays in the sandbox as its pid 1, whose
    # /proc/1/environ the browser could read.
    os.execve(command[0], command, {})


if __name__ == "__main__":
    main(sys.argv[1:])
