"""Placement: which GPUs and ports a run's processes take on a host, or why it waits."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostagent.placement import Gpu, HostInventory, Placement, RunNeeds, checkpoint_gib, place

CPU_HOST = HostInventory(name="cpu-1", cpu_inference_slots=2)
GPU_HOST = HostInventory(
    name="gpu-host-1",
    gpus=tuple(Gpu(i, "H100", 80.0) for i in range(4)),
    cuda_torch=True,
)


def needs(**over) -> RunNeeds:
    base = dict(inference_workers=1, backend="transformers", trainer_replicas=1, device="auto")
    return RunNeeds(**{**base, **over})


def test_cpu_runs_fill_the_inference_slots_then_wait_with_the_reason():
    first = place(needs(), CPU_HOST, taken=[], port_base=8200)
    assert isinstance(first, Placement) and first.device == "cpu"
    assert (first.router_port, first.worker_ports) == (8200, [8201])
    second = place(needs(), CPU_HOST, taken=[first], port_base=8200)
    assert isinstance(second, Placement)
    assert second.router_port == 8218 and second.worker_ports == [8219]  # apart from the first
    third = place(needs(), CPU_HOST, taken=[first, second], port_base=8200)
    assert third == (
        "needs 1 CPU inference worker; 0 of 2 are free on cpu-1 (DARTBOARD_CPU_INFERENCE_SLOTS)"
    )
    # The scripted oracle needs no inference worker: it always fits.
    assert isinstance(place(needs(inference_workers=0, trainer_replicas=0), CPU_HOST,
                            taken=[first, second], port_base=8200), Placement)  # fmt: skip


def test_a_gpu_run_takes_its_trainer_and_inference_gpus_and_the_next_run_the_rest():
    lora = needs(trainer_replicas=2, inference_workers=2, backend="vllm", weights_gib=16.0)
    first = place(lora, GPU_HOST, taken=[], port_base=8200)
    assert isinstance(first, Placement) and first.device == "cuda"
    assert sorted(first.trainer_gpus + first.inference_gpus) == [0, 1, 2, 3]
    assert not set(first.trainer_gpus) & set(first.inference_gpus)
    # vLLM took 90% of its GPUs, the trainer 24 GiB of its own: a second 2+2 run waits.
    waiting = place(lora, GPU_HOST, taken=[first], port_base=8200)
    assert waiting == (
        "needs 4 GPUs (2 for the trainer, 2 with 72 GiB free for inference); 0 more are free "
        "on gpu-host-1"
    )
    # A 1+1 run with vLLM sharing the trainer's GPU fits beside the first run's trainers.
    small = needs(backend="vllm", vllm_gpus="shared", vllm_gpu_memory=0.4, weights_gib=4.0)
    beside = place(small, GPU_HOST, taken=[first], port_base=8200)
    assert isinstance(beside, Placement)
    assert beside.inference_gpus == beside.trainer_gpus
    assert beside.trainer_gpus[0] in first.trainer_gpus


def test_a_full_fine_tune_too_big_for_one_gpu_waits_with_the_memory_it_needs():
    # fp32 weights, gradients and two moments plus a bf16 reference: 9x the bf16 weights
    full = needs(lora=False, weights_gib=7.5, trainer_replicas=1)
    assert place(full, GPU_HOST, taken=[], port_base=8200).gpu_gib == {"0": 75.5, "1": 9.5}
    big = needs(lora=False, weights_gib=15.0, trainer_replicas=1)
    assert place(big, GPU_HOST, taken=[], port_base=8200) == (
        "needs 1 GPU with 143 GiB free for the trainer; 0 are free on gpu-host-1"
    )
    sharded = needs(lora=False, weights_gib=15.0, trainer_replicas=2, shard=True)
    assert isinstance(place(sharded, GPU_HOST, taken=[], port_base=8200), Placement)


def test_gpus_with_a_cpu_torch_build_are_refused_with_the_fix():
    cpu_torch = HostInventory(name="gpu-host-2", gpus=GPU_HOST.gpus, cuda_torch=False)
    reason = place(needs(), cpu_torch, taken=[], port_base=8200)
    assert isinstance(reason, str) and "CPU build" in reason and "make torch-cuda" in reason
    # Asked for the CPU, the run goes there.
    assert place(needs(device="cpu"), cpu_torch, taken=[], port_base=8200).device == "cpu"
    assert place(needs(device="cuda"), CPU_HOST, taken=[], port_base=8200) == (
        "needs GPUs (device cuda); cpu-1 has none"
    )


def test_a_placement_survives_the_database():
    placed = place(needs(trainer_replicas=1), GPU_HOST, taken=[], port_base=8200)
    assert Placement.from_dict(placed.to_dict()) == placed


def test_a_checkpoint_is_sized_as_its_bf16_weights():
    shipped = Path(__file__).resolve().parents[2] / "policies" / "tiny-grounded"  # float32
    on_disk = (shipped / "model.safetensors").stat().st_size / 1024**3
    assert checkpoint_gib(str(shipped)) == pytest.approx(on_disk / 2)
    assert checkpoint_gib("artifact:policies/x@sha256:00") == 0.0  # fetched later
