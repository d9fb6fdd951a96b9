"""One run placed over several hosts: all of it or nothing, with what is missing where."""

from __future__ import annotations

from hostagent.cluster import ClusterPlacement, place_cluster
from hostagent.placement import PORTS_PER_RUN, Gpu, HostInventory, Placement, RunNeeds, place


def gpu_host(name: str, address: str, gpus: int = 8, gib: float = 80.0) -> HostInventory:
    return HostInventory(
        name=name,
        address=address,
        gpus=tuple(Gpu(i, "H100", gib) for i in range(gpus)),
        cuda_torch=True,
        env_kinds=("miniwob", "sim"),
    )


def needs(**over) -> RunNeeds:
    base = dict(inference_workers=1, backend="transformers", trainer_replicas=1, device="auto")
    return RunNeeds(**{**base, **over})


def placed(run: RunNeeds, hosts, taken=None, *, kinds=("miniwob",), env_workers=2):
    return place_cluster(
        run,
        hosts,
        taken=taken or {},
        port_bases={h.name: 8200 for h in hosts},
        env_kinds=set(kinds),
        env_workers=env_workers,
    )


def test_a_run_that_fits_one_host_goes_there_whole_as_on_one_machine():
    host = gpu_host("gpu-1", "10.0.0.1")
    plan = placed(needs(trainer_replicas=2, inference_workers=2, weights_gib=8.0), [host])
    assert isinstance(plan, ClusterPlacement) and plan.hosts == ["gpu-1"]
    only = plan.parts[0]
    alone = place(needs(trainer_replicas=2, inference_workers=2, weights_gib=8.0, device="cuda"),
                  host, taken=[], port_base=8200)  # fmt: skip
    assert isinstance(alone, Placement)
    assert (only.trainer_gpus, only.inference_gpus) == (alone.trainer_gpus, alone.inference_gpus)
    assert only.whole and only.env_workers == 2 and only.trainer_ranks == [0, 1]
    assert plan.router_url == "http://10.0.0.1:8200"
    # A host alone says its own words, as before there was a cluster.
    assert placed(needs(device="cuda"), [HostInventory(name="cpu-1", env_kinds=("miniwob",))]) == (
        "needs GPUs (device cuda); cpu-1 has none"
    )


def test_a_trainer_too_big_for_any_host_spans_two_and_meets_at_the_leaders_address():
    hosts = [gpu_host("gpu-1", "10.0.0.1"), gpu_host("gpu-2", "10.0.0.2")]
    run = needs(trainer_replicas=12, inference_workers=2, lora=False, weights_gib=15.0, shard=True)
    plan = placed(run, hosts)
    assert isinstance(plan, ClusterPlacement), plan
    one, two = plan.part("gpu-1"), plan.part("gpu-2")
    assert one is not None and two is not None and not one.whole
    assert sorted(one.trainer_ranks + two.trainer_ranks) == list(range(12))
    assert 0 in one.trainer_ranks and len(one.trainer_ranks) == 8  # as few hosts as hold it
    assert one.rendezvous == two.rendezvous == f"10.0.0.1:{one.router_port + PORTS_PER_RUN - 1}"
    assert one.trainer_world == two.trainer_world == 12
    # Inference on the GPUs left (the second host's), the router beside its first worker,
    # reaching every worker at its host's address.
    assert two.inference_gpus and two.router and not one.router
    assert plan.router_url == f"http://10.0.0.2:{two.router_port}"
    assert two.router_workers == [f"http://10.0.0.2:{port}" for port in two.worker_ports]
    assert one.env_workers + two.env_workers == 2


def test_nothing_starts_until_the_whole_run_fits_and_the_reason_names_each_host():
    hosts = [gpu_host("gpu-1", "10.0.0.1"), gpu_host("gpu-2", "10.0.0.2")]
    # Another run holds half of gpu-2.
    other = Placement(host="gpu-2", device="cuda", trainer_gpus=[0, 1, 2, 3],
                      gpu_gib={str(i): 79.0 for i in range(4)})  # fmt: skip
    run = needs(trainer_replicas=16, inference_workers=0, lora=False, weights_gib=15.0, shard=True)
    reason = placed(run, hosts, {"gpu-2": [other]})
    assert isinstance(reason, str)
    assert reason.startswith("needs 16 GPUs with ") and "GiB free for the trainer" in reason
    assert reason.endswith("8 free on gpu-1, 4 free on gpu-2")
    # Freed, the same run fits over both.
    assert isinstance(placed(run, hosts), ClusterPlacement)


def test_env_workers_go_to_hosts_that_run_their_kind_and_cpu_replicas_spread_by_slots():
    trainer = [
        HostInventory(
            name=f"train-{i}", address=f"10.0.1.{i}", cpu_inference_slots=0, cpu_trainer_slots=1
        )
        for i in (1, 2)
    ]
    serve = HostInventory(name="serve", address="10.0.1.3", cpu_inference_slots=1,
                          cpu_trainer_slots=0)  # fmt: skip
    envs = HostInventory(name="envs", address="10.0.1.4", cpu_inference_slots=0,
                         cpu_trainer_slots=0, env_kinds=("miniwob", "sim"))  # fmt: skip
    plan = placed(needs(trainer_replicas=2, device="cpu"), [*trainer, serve, envs])
    assert isinstance(plan, ClusterPlacement), plan
    assert [(p.host, p.trainer_ranks) for p in plan.parts if p.trainer_ranks] == [
        ("train-1", [0]),
        ("train-2", [1]),
    ]
    assert plan.part("serve").inference_gpus == [None] and plan.part("serve").router  # type: ignore[union-attr]
    assert plan.part("envs").env_workers == 2  # type: ignore[union-attr]
    assert plan.part("train-1").rendezvous.startswith("10.0.1.1:")  # type: ignore[union-attr]
    # Without the env host, no host runs MiniWoB++: the run waits, saying who runs what.
    reason = placed(needs(trainer_replicas=2, device="cpu"), [*trainer, serve])
    assert reason == (
        "needs env kinds ['miniwob'] on one host; none runs them all "
        "(train-1: none; train-2: none; serve: none)"
    )
    # A third replica finds no CPU trainer slot.
    reason = placed(needs(trainer_replicas=3, device="cpu"), [*trainer, serve, envs])
    assert reason == (
        "needs 3 CPU trainer replicas: 1 free on train-1, 1 free on train-2, 0 free on serve, "
        "0 free on envs (DARTBOARD_CPU_TRAINER_SLOTS)"
    )


def test_a_stored_plan_from_one_host_reads_as_that_hosts_whole_run():
    old = {"host": "vm", "device": "cpu", "inference_gpus": [None], "router_port": 8200,
           "worker_ports": [8201]}  # fmt: skip
    plan = ClusterPlacement.from_dict(old)
    assert plan.hosts == ["vm"] and plan.parts[0].whole
    assert ClusterPlacement.from_dict(plan.to_dict()) == plan
