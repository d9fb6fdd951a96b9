"""Fixtures shared by the rollout tests: the tiny policy and a perturbed copy, and a cluster
of two real inference workers behind a real router."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from core.policy import load_policy, save_checkpoint
from rollout.client import RouterAdmin
from tests.helpers import free_port, needs, wait_until
from tests.rollout.test_router import ROOT, SERVER, start_process, stop_process
from training.tiny_policy import build_tiny_policy


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny policy (v0) and a perturbed copy of it (v1)."""
    root = tmp_path_factory.mktemp("ckpt")
    v0 = build_tiny_policy(root / "v0")
    policy = load_policy(v0)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return v0, save_checkpoint(policy, root / "v1")


@dataclass
class Cluster:
    router: str
    workers: list[str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)


@pytest.fixture
@needs("live")
def cluster(checkpoints) -> Iterator[Cluster]:
    """Two inference workers at v0 and a router over them, as the launcher starts them."""
    started: list[subprocess.Popen] = []
    try:
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for port in ports:  # start both before waiting, so they load in parallel
            started.append(
                subprocess.Popen(
                    [
                        *SERVER,
                        "--policy",
                        str(checkpoints[0]),
                        "--port",
                        str(port),
                        "--threads",
                        "1",
                    ],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        router_port = free_port()
        router = f"http://127.0.0.1:{router_port}"
        args = ["rollout.router", "--port", str(router_port), "--probe-interval", "0.5"]
        for url in urls:
            args += ["--worker", url]
        started.append(start_process(args, health_url=f"{router}/health"))
        admin = RouterAdmin(router)
        wait_until(
            lambda: [w.status for w in admin.workers()] == ["active", "active"],
            timeout=90,
            what="both workers active",
        )
        admin.close()
        yield Cluster(router=router, workers=urls, procs=dict(zip(urls, started, strict=False)))
    finally:
        for proc in started:
            stop_process(proc)
