"""The trainer's memory plan (`training.memory_plan`): against the GPU peaks measured on the
H100/H200 (docs/gpu-and-vllm.md), against peaks of real updates measured here on the CPU at
two shapes, and what it picks and refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.imaging import QWEN25_VL, QWEN_MERGE, QWEN_PATCH
from training.config import TrainerConfig
from training.memory_plan import (
    GIB,
    DoesNotFit,
    ModelShape,
    Sample,
    TrainerRequest,
    checkpoint_shape,
    trainer_memory,
)

ROOT = Path(__file__).resolve().parents[2]

# bench/realsize.py's shapes, as the released config.json files give them.
MID = {
    "text_config": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936},
    "model_type": "qwen2_5_vl",
    "vision_config": {"depth": 8, "hidden_size": 1280, "intermediate_size": 3420},
}  # fmt: skip
QWEN25_7B = {
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
    "model_type": "qwen2_5_vl",
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420},
}  # fmt: skip
# One 1920x1080 screenshot at the released processor's bounds (10,764 patches).
SCREEN_PATCHES = QWEN25_VL.tokens(width=1920, height=1080) * QWEN_MERGE**2


@pytest.mark.parametrize(
    ("what", "config", "settings", "sample", "measured_gib"),
    [
        # docs/gpu-and-vllm.md, "On an H100 and an H200": one step of 5 screenshots, 14,141
        # tokens, 64 response tokens, micro-batch 1.
        ("mid LoRA r16", MID, {"lora_rank": 16, "checkpointing": False},
         Sample(tokens=14_141, reply=64, patches=5 * SCREEN_PATCHES), 22.0),
        ("mid full, KL", MID, {"lora_rank": 0, "checkpointing": False},
         Sample(tokens=14_141, reply=64, patches=5 * SCREEN_PATCHES), 62.0),
        ("mid full, KL, checkpointing", MID, {"lora_rank": 0, "checkpointing": True},
         Sample(tokens=14_141, reply=64, patches=5 * SCREEN_PATCHES), 18.4),
        # "The whole loop at 7B shape": the longest prompt 8,627 tokens (4 screenshots).
        ("7B LoRA r16, checkpointing", QWEN25_7B, {"lora_rank": 16, "checkpointing": True},
         Sample(tokens=8_627 + 64, reply=64, patches=4 * SCREEN_PATCHES), 20.7),
    ],
)  # fmt: skip
def test_plan_is_within_15_percent_of_the_gpu_peaks(
    what: str, config: dict, settings: dict, sample: Sample, measured_gib: float
) -> None:
    memory = trainer_memory(
        ModelShape.from_config(config), kl=True, micro_batch_tokens=sample.tokens,
        sample=sample, cuda=True, **settings,
    )  # fmt: skip
    assert abs(memory.total / GIB / measured_gib - 1) <= 0.15, (what, memory.describe())


def _request(config: dict, **settings: object) -> TrainerRequest:
    trainer = TrainerConfig(**settings)  # type: ignore[arg-type]
    sample = Sample.of_budgets(
        ModelShape.from_config(config), max_prompt_tokens=16_384, max_new_tokens=1024,
        max_images=5, image_tokens=SCREEN_PATCHES // QWEN_MERGE**2,
    )  # fmt: skip
    return TrainerRequest.of(trainer, shape=ModelShape.from_config(config), sample=sample)


def test_a_7b_full_fine_tune_on_one_80_gb_gpu_is_refused_saying_what_would_fit() -> None:
    with pytest.raises(DoesNotFit) as refused:
        _request(QWEN25_7B).plan(80.0)
    message = str(refused.value)
    assert "8.3B-parameter model (full fine-tuning" in message
    assert "AdamW 61.8" in message  # two fp32 moments of 8.3B parameters
    assert "trainer.replicas 4 with trainer.shard on" in message
    assert "trainer.lora_rank 16" in message
    # What it says would fit, fits.
    assert _request(QWEN25_7B, replicas=4, shard=True).plan(80.0).total <= 76 * GIB
    assert _request(QWEN25_7B, lora_rank=16).plan(80.0).total <= 76 * GIB


def test_auto_turns_checkpointing_on_only_where_the_gpu_needs_it() -> None:
    roomy = _request(MID, lora_rank=16).plan(141.0)  # an H200: 4 steps a micro-batch
    smaller = _request(MID, lora_rank=16).plan(40.0)  # fewer steps before recomputing
    tight = _request(MID, lora_rank=16).plan(24.0)
    assert not roomy.checkpointing and roomy.micro_batch_tokens == 4 * 17_408
    assert not smaller.checkpointing and smaller.micro_batch_tokens == 17_408
    assert tight.checkpointing and tight.total <= 20 * GIB
    pinned = _request(MID, lora_rank=16, gradient_checkpointing="off")
    with pytest.raises(DoesNotFit, match="without gradient checkpointing"):
        pinned.plan(24.0)


def test_auto_replicas_shard_a_full_fine_tune_over_the_fewest_gpus_that_hold_it() -> None:
    from training.memory_plan import trainer_layout

    def layout(gpus: int, gpu_gib: float | None = 80.0, **settings: object):
        return trainer_layout(TrainerConfig(**settings), _request(QWEN25_7B, **settings),  # type: ignore[arg-type]
                              gpu_gib=gpu_gib, gpus=gpus)  # fmt: skip  # one call

    assert layout(8) == (4, True)  # what the refusal of one replica says would fit
    assert layout(8, gpu_gib=141.0) == (2, True)  # H200s
    assert layout(2) == (1, False)  # nothing fits 2 GPUs: run create refuses it
    assert layout(8, lora_rank=16) == (1, False)  # LoRA fits one GPU
    assert layout(8, gpu_gib=None) == (1, False)  # on the CPU
    assert layout(8, replicas=4) == (4, True)  # shard auto: unsharded, 4 replicas do not fit
    assert layout(8, replicas=4, shard="off") == (4, False)
    assert trainer_layout(TrainerConfig(replicas=2), _request(MID, lora_rank=0, replicas=2),
                          gpu_gib=141.0, gpus=8) == (2, False)  # fmt: skip  # fits unsharded


def test_stored_true_and_false_still_read() -> None:
    from datamanager.config import RunConfig

    for stored, read in ((True, "on"), (False, "off")):
        config = RunConfig.from_dict({"trainer": {"gradient_checkpointing": stored}})
        assert config.trainer.gradient_checkpointing == read


def test_the_parameters_are_the_weights_own_count() -> None:
    from safetensors.torch import load_file

    policy = ROOT / "policies" / "tiny-grounded"
    shape = checkpoint_shape(policy)
    assert shape is not None
    assert shape.params == sum(t.numel() for t in load_file(policy / "model.safetensors").values())
    # The count from the config alone (no weights at hand) is within 2% of it.
    config = json.loads((policy / "config.json").read_text())
    assert abs(ModelShape.from_config(config).params / shape.params - 1) < 0.02


# ------------------------------------------------------------------ real peaks on the CPU

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
from training.tiny_policy import build_tiny_policy
from training.memory_plan import checkpoint_shape, trainer_memory, Sample, GIB

shape_args = json.loads(sys.argv[3])
out = Path(sys.argv[2])
build_tiny_policy(out / "model", arch="qwen2_5_vl", **shape_args)

import base64, io
from PIL import Image
from core.samples import TrainSample
from core.encoding import encode_batch, response_token_ids
from training.config import CurationConfig, TrainerConfig
from training.trainer import PolicyTrainer

def png(w, h, seed):
    img = Image.effect_noise((w, h), 60 + seed).convert("RGB")
    buf = io.BytesIO(); img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

torch.set_num_threads(2)
samples = [
    TrainSample(step_id=i, trajectory_id=i, group_id=i // 2,
                messages=[{"role": "user", "content": [
                    {"type": "text", "text": "Click the red button on the left. " * 60},
                    {"type": "image_url", "image_url": {"url": png(448, 448, i)}}]}],
                response_text="Thought: the red button.\nAction: click(start_box='(100,200)')" * 2,
                reward=float(i % 2), rollout_logprobs=[], mean_entropy=1.0, policy_version=0)
    for i in range(4)
]
lora = shape_args.pop("_lora", 0) if False else int(sys.argv[4])

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

import gc; gc.collect()
before = status("VmRSS")
settings = TrainerConfig(lr=1e-4, kl_coef=0.1, micro_batch=4, lora_rank=lora, **({"lora_alpha": 32} if lora else {}))
trainer = PolicyTrainer(config=settings, start_checkpoint=out / "model", run_dir=out / "run",
                        prompt_cache_bytes=0)
Path("/proc/self/clear_refs").write_text("5")
curation = CurationConfig(high_entropy=False, truncated_is=False)
for _ in range(2):
    trainer.update(samples, curation)
peak = status("VmHWM") - before
batch = encode_batch(trainer.policy, [s.messages for s in samples],
                     responses=[response_token_ids(trainer.policy, s.response_text) for s in samples])
tokens = int(batch.attention_mask.sum())
patches = int(batch.image_grid_thw.prod(-1).sum())
reply = int(batch.response_mask.sum(1).max())
shape = checkpoint_shape(out / "model")
per = Sample(tokens=tokens // 4, reply=reply, patches=patches // 4)
plan = trainer_memory(shape, lora_rank=lora, kl=True, checkpointing=False,
                      micro_batch_tokens=tokens, sample=per, cuda=False)
print(json.dumps({"ratio": plan.total / peak, "peak": peak, "plan": plan.total, "describe": plan.describe(), "tokens": tokens}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "lora"),
    [
        ({"hidden": 512, "layers": 6, "heads": 8, "kv_heads": 2, "intermediate": 2048,
          "vision_hidden": 256, "vision_depth": 4, "vision_heads": 4}, 0),
        ({"hidden": 768, "layers": 8, "heads": 12, "kv_heads": 4, "intermediate": 3072,
          "vision_hidden": 384, "vision_depth": 4, "vision_heads": 6}, 16),
    ],
)  # fmt: skip
def test_plan_is_within_20_percent_of_a_real_update_on_the_cpu(
    shape: dict, lora: int, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT), str(tmp_path), json.dumps(shape), str(lora)],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = measured["plan"] / measured["peak"]
    assert 0.8 <= ratio <= 1.2, measured


# ------------------------------------------------------------------ at create, and placement


def _seven_b_checkpoint(path: Path) -> Path:
    """Qwen2.5-VL-7B's config.json and the released processor's bounds: what the plan reads
    (no weights: the shape is counted from the config)."""
    path.mkdir()
    config = {**QWEN25_7B, "architectures": ["Qwen2_5_VLForConditionalGeneration"]}
    (path / "config.json").write_text(json.dumps(config))
    processor = {"patch_size": QWEN_PATCH, "merge_size": QWEN_MERGE, "temporal_patch_size": 2,
                 "min_pixels": QWEN25_VL.min_pixels, "max_pixels": QWEN25_VL.max_pixels}  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    return path


@pytest.mark.django_db
def test_run_create_refuses_a_trainer_no_gpu_of_the_cluster_holds(tmp_path: Path) -> None:
    from django.utils import timezone

    from datamanager.config import ConfigInvalid
    from datamanager.models import Host
    from datamanager.services.runs import run_config_validate

    policy = str(_seven_b_checkpoint(tmp_path / "qwen7b"))
    budgets = {"max_prompt_tokens": 16_384, "max_new_tokens": 1024, "max_images": 5}
    full = {"policy": policy, "device": "cuda", "rollout": budgets}
    run_config_validate(data=full, user=None)  # no GPU host has reported: placement decides
    Host.objects.create(name="gpu-1", cuda_torch=True, last_seen=timezone.now(),
                        gpus=[{"index": 0, "name": "H100", "memory_gib": 80.0}])  # fmt: skip
    with pytest.raises(ConfigInvalid) as refused:  # one 80 GB GPU in the cluster
        run_config_validate(data=full, user=None)
    assert refused.value.problems[0].path == "trainer"
    assert "the largest GPU has 80 GiB" in str(refused.value)
    assert "trainer.replicas 4 with trainer.shard on" in str(refused.value)
    Host.objects.filter(name="gpu-1").update(
        gpus=[{"index": i, "name": "H100", "memory_gib": 80.0} for i in range(8)]
    )
    run_config_validate(data=full, user=None)  # auto: 4 sharded replicas of the 8 GPUs
    with pytest.raises(ConfigInvalid):  # one replica, as asked: no GPU holds it
        run_config_validate(data={**full, "trainer": {"replicas": 1}}, user=None)
    run_config_validate(data={**full, "trainer": {"lora_rank": 16}}, user=None)
    run_config_validate(data={**full, "trainer": {"replicas": 4, "shard": True}}, user=None)
    run_config_validate(data={**full, "device": "cpu"}, user=None)  # not a GPU run
    small_vllm = {**full, "trainer": {"lora_rank": 16},
                  "rollout": {**budgets, "backend": "vllm", "vllm_gpu_memory": 0.2}}  # fmt: skip  # a run's settings, one section a line
    with pytest.raises(ConfigInvalid) as refused:
        run_config_validate(data=small_vllm, user=None)
    assert [p.path for p in refused.value.problems] == ["rollout.vllm_gpu_memory"]


def test_placement_takes_the_plans_memory(tmp_path: Path) -> None:
    from hostagent.placement import Gpu, HostInventory, RunNeeds, place

    policy = _seven_b_checkpoint(tmp_path / "qwen7b")
    shape = checkpoint_shape(policy)
    assert shape is not None
    sample = Sample.of_budgets(shape, max_prompt_tokens=16_384, max_new_tokens=1024,
                               max_images=5, image_tokens=SCREEN_PATCHES // QWEN_MERGE**2)  # fmt: skip
    host = HostInventory(name="gpu-1", cuda_torch=True,
                         gpus=tuple(Gpu(i, "H100", 80.0) for i in range(2)))  # fmt: skip
    lora = RunNeeds(inference_workers=1, backend="transformers", trainer_replicas=1,
                    device="cuda", weights_gib=15.4,
                    trainer=TrainerRequest.of(TrainerConfig(lora_rank=16), shape=shape, sample=sample))  # fmt: skip
    placed = place(lora, host, taken=[], port_base=9000)
    assert not isinstance(placed, str), placed
    planned = lora.trainer.plan(80.0).total / GIB  # type: ignore[union-attr]
    assert placed.gpu_gib[str(placed.trainer_gpus[0])] == pytest.approx(planned + 4.0, abs=0.01)
    # The inference worker: bf16 weights and a full batch's KV cache at the run's context.
    worker = placed.gpu_gib[str(placed.inference_gpus[0])]
    assert worker == pytest.approx(shape.params * 2 / GIB + 8 * 57_344 * 17_408 / GIB + 4, abs=0.01)
    full = RunNeeds(inference_workers=1, backend="transformers", trainer_replicas=1,
                    device="cuda", weights_gib=15.4, lora=False,
                    trainer=TrainerRequest.of(TrainerConfig(), shape=shape, sample=sample))  # fmt: skip
    reason = place(full, host, taken=[], port_base=9000)
    assert isinstance(reason, str) and reason.startswith("gpu-1: the trainer needs")


@pytest.mark.django_db
def test_run_create_refuses_more_gpus_than_the_cluster_has_with_its_totals() -> None:
    from django.utils import timezone

    from datamanager.config import ConfigInvalid
    from datamanager.models import Host
    from datamanager.services.runs import run_config_validate

    wide = {"device": "cuda", "trainer": {"replicas": 16},
            "rollout": {"backend": "vllm", "inference_workers": 2}}  # fmt: skip  # one setting a line
    run_config_validate(data=wide, user=None)  # no GPU host has reported: placement decides
    for name in ("gpu-1", "gpu-2"):
        Host.objects.create(name=name, cuda_torch=True, last_seen=timezone.now(),
                            gpus=[{"index": i, "name": "H100", "memory_gib": 80.0} for i in range(8)])  # fmt: skip  # one host a line
    with pytest.raises(ConfigInvalid) as refused:
        run_config_validate(data=wide, user=None)
    problem = refused.value.problems[0]
    assert problem.path == "rollout.inference_workers"
    assert problem.message == (
        "the run needs 18 GPUs (16 for the trainer's replicas, 2 for inference), but the "
        "cluster has 16 (2 GPU hosts, the largest with 8)"
    )
    shared = {**wide, "rollout": {**wide["rollout"], "vllm_gpus": "shared", "vllm_gpu_memory": 0.4}}
    run_config_validate(data=shared, user=None)  # vLLM on the trainer's GPUs: 16 fit, over 2 hosts
    run_config_validate(data={**wide, "device": "auto"}, user=None)  # may run on a CPU host


def test_inference_memory_counts_the_weights_and_the_kv_cache() -> None:
    from training.memory_plan import inference_bytes, vllm_fits

    shape = ModelShape.from_config(QWEN25_7B)
    # Qwen2.5-VL-7B: 28 layers x 4 KV heads x 128 = 512 wide keys and values, bf16.
    one = inference_bytes(shape, context_tokens=32_768, sequences=1)
    assert one == shape.params * 2 + 2 * 28 * 512 * 2 * 32_768
    assert vllm_fits(shape, context_tokens=32_768, share_gib=0.9 * 80) is None
    short = vllm_fits(shape, context_tokens=32_768, share_gib=0.2 * 80)
    assert short is not None and "(16 GiB) holds less than" in short


def test_the_agents_place_an_auto_trainer_as_its_plan_shards_it(tmp_path: Path) -> None:
    """A 7B full fine-tune at the defaults on two hosts of 8 x 80 GB: four sharded
    replicas on one host, and its train worker is told so."""
    from datamanager.config import RunConfig
    from hostagent.agent import run_needs, run_specs
    from hostagent.cluster import ClusterPlacement, place_cluster
    from hostagent.placement import Gpu, HostInventory
    from training.config import REPLICAS_ENV, SHARD_ENV

    policy = str(_seven_b_checkpoint(tmp_path / "qwen7b"))
    cfg = RunConfig.from_dict({"policy": policy, "device": "cuda", "rollout": {
        "max_prompt_tokens": 16_384, "max_new_tokens": 1024, "max_images": 5}})  # fmt: skip  # one config
    hosts = [HostInventory(name=f"gpu-{i}", address=f"10.0.0.{i}", cuda_torch=True,
                           gpus=tuple(Gpu(g, "H100", 80.0) for g in range(8)),
                           env_kinds=("miniwob",)) for i in (1, 2)]  # fmt: skip  # two hosts
    needs = run_needs(cfg, policy, hosts=hosts)
    assert (needs.trainer_replicas, needs.shard) == (4, True)
    plan = place_cluster(needs, hosts, taken={}, port_bases={h.name: 8200 for h in hosts},
                         env_kinds={"miniwob"}, env_workers=2)  # fmt: skip
    assert isinstance(plan, ClusterPlacement) and plan.hosts == ["gpu-1"]
    (part,) = plan.parts
    assert len(part.trainer_gpus) == 4 and part.trainer_shard
    specs = run_specs(run_id=7, cfg=cfg, placement=part, checkpoint=policy, version=0)
    train = next(s for s in specs if s.name == "run-7-worker-train")
    assert train.env[REPLICAS_ENV] == "4" and train.env[SHARD_ENV] == "1"
