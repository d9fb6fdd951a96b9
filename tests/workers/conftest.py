"""Fixtures of the worker tests."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def small_disk(tmp_path):
    """A 30 MB filesystem (tmpfs): less than one tiny-policy version with its optimizer state.
    Root only (skipped otherwise); unmounted after."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)
