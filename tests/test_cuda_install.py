"""The GPU hosts' installs resolve as PyPI serves them: `make torch-cuda`'s requirements-cuda.txt
(torch 2.13.0's CUDA wheel with its nvidia-* libraries and triton) and vLLM's GPU environment
(requirements-gpu.txt), for Linux x86_64 and CPython 3.11, metadata only (`pip install
--dry-run --report`: no wheel is downloaded). A library torch or vLLM needs that the files
leave out, or a pin PyPI does not serve, fails here, not on the GPU host.

They need PyPI (the package registry; no other network): without it they skip, saying so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INDEX = "https://pypi.org/simple"
# The glibc versions wheels name (manylinux_2_5 .. _2_36, Debian 12's glibc), older aliases
# after: pip matches --platform tags exactly, so a host's whole list is spelled out.
PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(36, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]

pytestmark = pytest.mark.slow


def _pins(path: Path) -> dict[str, str]:
    """name -> version of a requirements file's `name==version` lines (names normalised)."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
        if match:
            pins[_normal(match.group(1))] = match.group(2)
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def pypi() -> str:
    try:
        urllib.request.urlopen(f"{INDEX}/pip/", timeout=10).close()
    except (urllib.error.URLError, OSError) as exc:
        pytest.skip(f"PyPI is not reachable from here ({exc}): the install cannot be resolved")
    return INDEX


def resolve(tmp_path: Path, *args: str) -> dict[str, str]:
    """What pip would install into an empty GPU host's environment: name -> version."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--quiet",
               "--ignore-installed", "--target", str(tmp_path / "nowhere"),
               "--report", str(report), "--only-binary=:all:", "--python-version", "3.11",
               "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none",
               "--index-url", INDEX, "--disable-pip-version-check"]  # fmt: skip
    for platform in PLATFORMS:
        command += ["--platform", platform]
    # No pip configuration of this machine (a local wheel directory holds the CPU torch).
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run(
        [*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"pip cannot resolve {args}:\n{done.stderr[-3000:]}"
    installs = json.loads(report.read_text())["install"]
    return {_normal(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


def test_torch_cuda_resolves_with_every_library_it_needs(pypi: str, tmp_path: Path) -> None:
    cuda = _pins(ROOT / "requirements-cuda.txt")
    lock = _pins(ROOT / "requirements.lock")
    assert cuda["torch"] == lock["torch"], "the GPU hosts' torch is the lock's, built for CUDA"
    resolved = resolve(tmp_path, "-r", "requirements-cuda.txt", "-c", "requirements.lock")
    # `make torch-cuda` installs requirements-cuda.txt --no-deps into .venv, which holds the
    # lock: whatever else torch needs must be in one of the two.
    missing = {
        name: version
        for name, version in resolved.items()
        if name not in cuda and name not in lock and name not in {"setuptools", "pip"}
    }
    assert not missing, f"torch {cuda['torch']} needs these, in neither file: {missing}"
    assert {n for n in cuda if n.startswith("nvidia-")} <= set(resolved)
    assert "triton" in resolved, "PyPI's Linux torch wheel asks for triton"


def test_vllm_gpu_environment_resolves_on_the_trainers_torch(pypi: str, tmp_path: Path) -> None:
    resolved = resolve(tmp_path, "-r", "requirements-gpu.txt", "-c", "requirements-cuda.txt")
    cuda = _pins(ROOT / "requirements-cuda.txt")
    assert resolved["vllm"] == _pins(ROOT / "requirements-gpu.txt")["vllm"]
    # The same torch and NCCL on both sides of a weight sync over a process group.
    for name in ("torch", "nvidia-nccl-cu13"):
        assert resolved[name] == cuda[name], (name, resolved[name], cuda[name])
