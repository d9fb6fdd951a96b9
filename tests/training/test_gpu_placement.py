"""Where each process of a GPU host works, decided by pure functions the CPU can check:
trainer replica r on GPU r with NCCL bound to it, vLLM after the trainer's GPUs or beside it
only with a memory split (refused at run validation otherwise)."""

from __future__ import annotations

import pytest

from datamanager.config import ConfigError, RunConfig
from hostagent.launcher import default_specs
from rollout.vllm_command import vllm_gpus
from training.replica_group import GroupSetup, group_setup


def test_each_replica_binds_its_own_gpu_and_nccl_to_it() -> None:
    assert group_setup(local_rank=3, cuda=True) == GroupSetup(backend="nccl", device="cuda:3")
    assert group_setup(local_rank=3, cuda=False) == GroupSetup(backend="gloo", device="cpu")
    assert GroupSetup(backend="gloo", device="cpu").apply() == {}  # nothing to bind on CPUs


def test_vllm_goes_after_the_trainers_gpus_unless_shared() -> None:
    assert vllm_gpus(workers=2, placement="after_trainer", trainer_replicas=2) == [2, 3]
    assert vllm_gpus(workers=2, placement="shared", trainer_replicas=2) == [0, 1]


def test_vllm_sharing_the_trainers_gpu_without_a_memory_split_is_refused() -> None:
    shared = {"backend": "vllm", "vllm_gpus": "shared"}
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_dict({"rollout": shared})  # vLLM's 0.9 beside the trainer
    assert refused.value.path == "rollout.vllm_gpu_memory"
    assert "would take 90% of it: the trainer runs out of memory" in str(refused.value)
    cfg = RunConfig.from_dict({"rollout": {**shared, "vllm_gpu_memory": 0.45}})
    assert cfg.rollout.vllm_gpu_memory == 0.45
    RunConfig.from_dict({"rollout": {"backend": "vllm"}})  # after the trainer: its own GPU


def test_the_launcher_puts_each_vllm_on_its_planned_gpu_with_its_share(settings) -> None:
    specs = default_specs(
        host="127.0.0.1", port=8000, env_slots=1, inference_policy="/models/policy",
        inference_workers=2, backend="vllm", vllm_gpus=[2, 3], vllm_gpu_memory=0.45,
    )  # fmt: skip
    vllm = {s.name: s for s in specs}["vllm-1"]
    assert vllm.env["CUDA_VISIBLE_DEVICES"] == "3"
    assert vllm.argv[vllm.argv.index("--gpu-memory-utilization") + 1] == "0.45"


def test_vision_adapters_are_refused_on_vllm_which_would_ignore_them() -> None:
    lora = {"lora_rank": 8, "lora_vision": True}
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_dict({"rollout": {"backend": "vllm"}, "trainer": lora})
    assert refused.value.path == "trainer.lora_vision"
    assert "its rollouts would ignore the vision tower's adapters" in str(refused.value)
    RunConfig.from_dict({"trainer": lora})  # the transformers server applies them
