"""Where a run's routers and inference workers listen: the host's cluster address
(DARTBOARD_HOST_ADDRESS), which its agent reports, and a loopback address said to be wrong
when other hosts report."""

from __future__ import annotations

import pytest

from datamanager.config import RunConfig
from hostagent.agent import cluster_address_problem, run_specs
from hostagent.placement import Placement

pytestmark = pytest.mark.django_db


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_a_runs_router_and_workers_listen_on_the_hosts_cluster_address(settings, backend) -> None:
    settings.DARTBOARD_HOST_ADDRESS = "10.20.0.7"
    cfg = RunConfig.from_dict({"policy": "shipped", "rollout": {"backend": backend}})
    placement = Placement(host="gpu-1", device="cpu", inference_gpus=[None, None],
                          router_port=9000, worker_ports=[9001, 9002])  # fmt: skip  # the plan
    specs = {s.name: s for s in run_specs(run_id=7, cfg=cfg, placement=placement,
                                          checkpoint="/ckpt", version=3)}  # fmt: skip  # as the agent calls it
    router = specs["run-7-router"].argv
    assert _flag(router, "--host") == "10.20.0.7"
    workers = [router[i + 1] for i, arg in enumerate(router) if arg == "--worker"]
    assert workers == ["http://10.20.0.7:9001", "http://10.20.0.7:9002"]
    for i in (0, 1):
        assert _flag(specs[f"run-7-inference-{i}"].argv, "--host") == "10.20.0.7"


def test_a_loopback_address_is_said_once_other_hosts_report() -> None:
    assert cluster_address_problem("127.0.0.1", []) is None  # one host: loopback is right
    assert cluster_address_problem("10.20.0.7", ["gpu-2"]) is None
    said = cluster_address_problem("127.0.0.1", ["gpu-2", "env-1"])
    assert said is not None and "127.0.0.1, a loopback address" in said
    assert "2 other hosts report (env-1, gpu-2)" in said and "DARTBOARD_HOST_ADDRESS" in said
    assert cluster_address_problem("localhost", ["gpu-2"]) is not None
    assert cluster_address_problem("::1", ["gpu-2"]) is not None
