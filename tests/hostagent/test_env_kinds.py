"""What env kinds a host agent offers the cluster: what the host can run, as its settings
choose, and none whose sandbox the agent cannot make (as Slurm runs it: not root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOW = (
    "import django; django.setup()\n"
    "from hostagent.agent import env_kinds_here\n"
    "print(','.join(env_kinds_here()))\n"
)


def offered(*wrap: str, **env: str) -> subprocess.CompletedProcess[str]:
    own = {k: v for k, v in os.environ.items() if not k.startswith("DARTBOARD_ENV_KINDS")}
    return subprocess.run(
        [*wrap, sys.executable, "-c", SHOW],
        env={**own, "DJANGO_SETTINGS_MODULE": "dartboard.settings", **env},
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip  # one argument a line would hide the command


pytestmark = pytest.mark.slow  # each case starts Django in a child process

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not Path("/usr/bin/chromium").exists(),
    reason="needs root, unshare and chromium",
)


@needs_root
def test_an_agent_that_cannot_make_sandboxes_does_not_offer_browsers_or_desktops():
    assert "miniwob" in offered().stdout.split(",")
    # A user namespace: the agent's uid 0 there has no cgroup or mount rights on the host.
    unprivileged = offered("unshare", "--user", "--map-root-user")
    assert unprivileged.returncode == 0, unprivileged.stderr
    assert unprivileged.stdout.strip() == "osworld,sim"
    assert "does not offer miniwob" in unprivileged.stderr
    # The admin's choice to run them without limits brings them back.
    allowed = offered("unshare", "--user", "--map-root-user", DARTBOARD_ALLOW_UNLIMITED_SANDBOX="1")
    assert "miniwob" in allowed.stdout.split(",")


def test_the_settings_choose_among_what_the_host_can_run():
    assert offered(DARTBOARD_ENV_KINDS="none").stdout.strip() == ""
    assert offered(DARTBOARD_ENV_KINDS="sim").stdout.strip() == "sim"
    wrong = offered(DARTBOARD_ENV_KINDS="sim,minwob")
    assert wrong.returncode != 0
    assert "DARTBOARD_ENV_KINDS='sim,minwob' names minwob, not an env kind" in wrong.stderr
