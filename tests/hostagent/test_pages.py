"""What the dashboard shows of hosts and of each run's own processes."""

from __future__ import annotations

import pytest
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import Host, PlacementState, RunPlacement
from datamanager.services.placement import placement_claim, placement_queue, placement_wait
from datamanager.services.runs import run_create

pytestmark = pytest.mark.django_db


def test_the_runs_page_lists_hosts_with_what_their_runs_take(ada_client):
    gpu = Host.objects.create(
        name="gpu-host-1",
        gpus=[{"index": i, "name": "H100", "memory_gib": 80.0} for i in range(2)],
        cuda_torch=True,
        cpu_cores=64,
        memory_gib=1000,
        env_kinds=["miniwob", "osworld", "sim"],
        last_seen=timezone.now(),
    )
    run = run_create(name="qwen-7b", config=RunConfig())
    placement = placement_queue(run_id=run.pk)
    plan = {"host": "gpu-host-1", "device": "cuda", "trainer_gpus": [0], "inference_gpus": [1],
            "router_port": 8200, "worker_ports": [8201], "gpu_gib": {"0": 16.0, "1": 72.0}}  # fmt: skip
    assert placement_claim(placement_id=placement.pk, host=gpu, plan=plan,
                           router_url="http://127.0.0.1:8200")  # fmt: skip
    page = ada_client.get("/").content.decode()
    assert "GPU 0 H100: 16 of 80 GiB taken, GPU 1 H100: 72 of 80 GiB taken" in page
    assert "64 cores, 1000 GiB; CPU inference 0 of 2" in page and "qwen-7b</a>" in page
    detail = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert ("Processes: starting on gpu-host-1 (trainer on GPU 0; inference on GPU 1; "
            "router http://127.0.0.1:8200)") in detail  # fmt: skip


def test_a_queued_run_says_why_it_waits_and_a_cpu_torch_gpu_host_says_so(ada_client):
    Host.objects.create(
        name="gpu-host-2",
        gpus=[{"index": 0, "name": "A100", "memory_gib": 40.0}],
        cuda_torch=False,
        last_seen=timezone.now(),
    )
    run = run_create(name="big", config=RunConfig())
    placement = placement_queue(run_id=run.pk)
    placement_wait(placement_id=placement.pk, reason="queued: needs 4 GPUs; 1 is free")
    detail = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "Processes: queued: needs 4 GPUs; 1 is free" in detail
    page = ada_client.get("/").content.decode()
    assert "unusable: this torch is the CPU build; make torch-cuda" in page
    assert RunPlacement.objects.get().state == PlacementState.QUEUED


def test_a_run_whose_router_never_answers_says_which_log_to_read(tmp_path):
    from datetime import timedelta

    from datamanager.models import Run
    from hostagent.agent import SLOW_START_S, HostAgent
    from tests.helpers import free_port

    host = Host.objects.create(name="h", last_seen=timezone.now())
    run = run_create(name="stuck", config=RunConfig())
    placement = placement_queue(run_id=run.pk)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: its worker keeps crashing
    assert placement_claim(placement_id=placement.pk, host=host, plan={}, router_url=url)
    agent = HostAgent(home=tmp_path, name="h")
    agent.host = host
    agent._promote_starting()
    assert "no live inference worker" not in Run.objects.get(pk=run.pk).status_message
    RunPlacement.objects.filter(pk=placement.pk).update(
        updated_at=timezone.now() - timedelta(seconds=SLOW_START_S + 1)
    )
    agent._promote_starting()
    message = Run.objects.get(pk=run.pk).status_message
    assert f"router at {url} has no live inference worker after 300 s" in message
    assert str(tmp_path / "logs" / f"run-{run.pk}-inference-0.log") in message


def test_a_run_spread_over_hosts_shows_what_each_host_runs(ada_client):
    from hostagent.cluster import ClusterPlacement, place_cluster
    from hostagent.placement import Gpu, HostInventory, RunNeeds

    gpus = tuple(Gpu(g, "H100", 80.0) for g in range(2))
    reported = [{"index": g.index, "name": g.name, "memory_gib": g.memory_gib} for g in gpus]
    # Loopback addresses where nothing listens: the page asks the router for its health.
    inventories = [
        HostInventory(name=f"gpu-{i}", address=f"127.0.9.{i}", cuda_torch=True, gpus=gpus)
        for i in (1, 2)
    ]
    hosts = [
        Host.objects.create(name=inv.name, address=inv.address, cuda_torch=True, gpus=reported,
                            last_seen=timezone.now())
        for inv in inventories
    ]  # fmt: skip
    needs = RunNeeds(inference_workers=1, backend="transformers", trainer_replicas=3,
                     device="cuda", lora=False, weights_gib=7.0, shard=True)  # fmt: skip
    plan = place_cluster(needs, inventories, taken={}, port_bases={"gpu-1": 8200, "gpu-2": 8200},
                         env_kinds=set(), env_workers=0)  # fmt: skip
    assert isinstance(plan, ClusterPlacement) and plan.hosts == ["gpu-1", "gpu-2"]
    run = run_create(name="spread", config=RunConfig())
    placement = placement_queue(run_id=run.pk)
    assert placement_claim(placement_id=placement.pk, host=hosts[1], hosts=hosts,
                           plan=plan.to_dict(), router_url=plan.router_url)  # fmt: skip
    detail = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert (
        "Processes: starting over 2 hosts: gpu-1 (127.0.9.1): trainer ranks 0, 1 on GPU 0, 1; "
        "gpu-2 (127.0.9.2): trainer rank 2 on GPU 0, 1 inference worker on GPU 1, the router; "
        f"router http://127.0.9.2:{plan.lead.router_port}"
    ) in detail
    page = ada_client.get("/").content.decode()
    assert page.count("spread</a>") == 3  # in the runs' list, and under each of its hosts
    # Each host's GPUs carry its own part: 29 GiB a trainer shard, 9 the inference worker.
    assert "GPU 0 H100: 29 of 80 GiB taken, GPU 1 H100: 29 of 80 GiB taken" in page
    assert "GPU 0 H100: 29 of 80 GiB taken, GPU 1 H100: 9 of 80 GiB taken" in page
