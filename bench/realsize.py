"""Memory of one training step of Qwen2.5-VL-3B- and -7B-shaped policies, per setting, and a
check of the plan against a real LoRA update of a mid-size model on this machine.

    .venv/bin/python bench/realsize.py                 # the plan table (a few minutes, CPU)
    .venv/bin/python bench/realsize.py --validate      # + the real update (about 10 minutes)

The plan, per GPU, for one micro-batch of one step (5 screenshots at 1920x1080 in one
sequence, about 14,000 tokens, 64 response tokens):

- weights: every parameter (counted on the meta device from the released configs' shapes; no
  download) plus the LoRA adapters; divided by the shards (FSDP2 full sharding);
- gradients and AdamW's two moments: of the trainable parameters (all, or the adapters), in
  the training dtype, divided by the shards;
- the KL reference: a second copy of the weights under full fine-tuning; nothing under LoRA
  (the same weights with the adapters off);
- activations: what autograd keeps for the backward pass, MEASURED on this CPU by running real
  forward passes of the same widths with 1 and 2 decoder layers (and 1 and 2 vision blocks)
  under a saved-tensor hook and taking the difference per layer and per token; then
  scaled to the real depth and token count. Under LoRA the vision tower is frozen and keeps
  nothing. With gradient checkpointing a layer keeps only its input, plus one layer's
  activations while it is recomputed. Attention is assumed linear in memory (flash or
  memory-efficient kernels, as on GPUs); logits are taken for the response tokens only
  (`core.generation.sequence_logprobs`).

"Fits 80 GB" leaves 4 GB for the CUDA context and the allocator's slack (76 GB planned).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # noqa: E402

from core.imaging import QWEN25_VL, ImageGeometry  # noqa: E402
from core.lora import LANGUAGE_TARGETS, LoraSpec, add_adapters  # noqa: E402

GB = 1e9
FITS = 76 * GB
LORA = LoraSpec(rank=16, alpha=32)
SCREENS, SCREEN = 5, (1920, 1080)
TEXT_TOKENS, RESPONSE_TOKENS = 700, 64

VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16}
SHAPES: dict[str, dict] = {  # the released config.json shapes
    "Qwen2.5-VL-3B": {
        "text": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                 "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936},
        "tie": True,
    },
    "Qwen2.5-VL-7B": {
        "text": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064},
        "tie": False,
    },
}  # fmt: skip


def config_of(text: dict, *, tie: bool, vision: dict, layers: int | None = None,
              depth: int | None = None, vocab: int | None = None) -> Qwen2_5_VLConfig:  # fmt: skip
    text = {**text, "max_window_layers": text["num_hidden_layers"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [16, 24, 24]}}  # fmt: skip
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    half = head_dim // 2
    text["rope_parameters"]["mrope_section"] = [
        half - 2 * (3 * half // 8),
        3 * half // 8,
        3 * half // 8,
    ]
    if layers is not None:
        text["num_hidden_layers"] = text["max_window_layers"] = layers
    if vocab is not None:
        text["vocab_size"] = vocab
    vision = {**vision, "out_hidden_size": text["hidden_size"]}
    if depth is not None:
        vision["depth"] = depth
    vision["fullatt_block_indexes"] = [i for i in (7, 15, 23, 31) if i < vision["depth"]] or [
        vision["depth"] - 1
    ]
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie,
                            image_token_id=2, video_token_id=3, vision_start_token_id=4,
                            vision_end_token_id=5)  # fmt: skip


@dataclass(frozen=True)
class Counts:
    params: int
    lora: int  # adapter parameters at LORA's rank on the language model's projections


def counts(config: Qwen2_5_VLConfig) -> Counts:
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    params = sum(p.numel() for p in model.parameters())
    lora = sum(
        LORA.rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and re.fullmatch(LANGUAGE_TARGETS, name)
    )
    return Counts(params=params, lora=lora)


# ------------------------------------------------------------------ measured activations


def saved_bytes(model: nn.Module, inputs: dict, response: int, vocab: int) -> tuple[int, int]:
    """Bytes of the distinct tensors autograd saves in one forward (the backward's memory):
    all of them, and those over the vocabulary (the response logits and their softmax)."""
    seen: dict[tuple[int, int], int] = {}
    over_vocab: dict[tuple[int, int], int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() in weights:
            return t  # a weight (or its transpose) is counted as a weight
        seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        if t.dim() and t.shape[-1] == vocab:
            over_vocab[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs, use_cache=False, logits_to_keep=response + 1)
        loss = out.logits.float().log_softmax(-1).mean()
    loss.backward()
    del out, loss
    return sum(seen.values()), sum(over_vocab.values())


def probe_inputs(*, text_tokens: int, side: int) -> tuple[dict, int, int]:
    """One image of side x side pixels inside text_tokens of text: inputs, tokens, patches."""
    grid = side // 14
    patches = grid * grid
    image_tokens = patches // 4
    ids = [7] * (text_tokens // 2) + [4] + [2] * image_tokens + [5] + [7] * (text_tokens // 2)
    input_ids = torch.tensor([ids])
    pixel_values = torch.randn(patches, 3 * 2 * 14 * 14)
    inputs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([[1, grid, grid]]),
    }
    return inputs, len(ids), patches


@dataclass(frozen=True)
class Activations:
    base_per_token: float  # embeddings, final norm
    logits_per_position_vocab: float  # response logits, log-softmax, entropy (per vocab entry)
    lm_per_token_layer: float
    vision_per_patch_block: float  # 0 when the vision tower is frozen
    lm_boundary_per_token: float  # what a checkpointed decoder layer keeps (its input)
    vision_boundary_per_patch: float


def measure_activations(shape: dict, *, dtype: torch.dtype, lora: bool) -> Activations:
    """Per-layer, per-token saved bytes from real forwards at the shape's widths."""
    results = {}
    logits = 0
    text = dict(shape["text"])
    for layers, depth in ((1, 1), (2, 1), (1, 2)):
        config = config_of(text, tie=shape["tie"], vision=VISION, layers=layers, depth=depth,
                           vocab=2048)  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration(config).to(dtype)
        if lora:
            model = add_adapters(model, LORA, base=ROOT)
        inputs, tokens, patches = probe_inputs(text_tokens=256, side=224)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        results[(layers, depth)], logits = saved_bytes(model, inputs, RESPONSE_TOKENS, 2048)
        del model
        gc.collect()
    lm_layer = (results[(2, 1)] - results[(1, 1)]) / tokens
    vision_block = max(0.0, (results[(1, 2)] - results[(1, 1)]) / patches)
    rest = results[(1, 1)] - lm_layer * tokens - vision_block * patches - logits
    size = torch.finfo(dtype).bits // 8
    return Activations(
        base_per_token=max(0.0, rest) / tokens,
        logits_per_position_vocab=logits / ((RESPONSE_TOKENS + 1) * 2048),
        lm_per_token_layer=lm_layer,
        vision_per_patch_block=vision_block,
        lm_boundary_per_token=shape["text"]["hidden_size"] * size,
        vision_boundary_per_patch=0.0 if lora else VISION["hidden_size"] * size,
    )


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Plan:
    weights: float
    grads: float
    optimizer: float
    reference: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.reference + self.activations


def plan(c: Counts, act: Activations, *, layers: int, depth: int, lora: bool,
         frozen_bytes: int, checkpointing: bool, shards: int, tokens: int, patches: int,
         vocab: int, sequences: int = 1, response: int = RESPONSE_TOKENS,
         kl: bool = True, master_bytes: int = 4) -> Plan:  # fmt: skip
    """What the trainer keeps (training.trainer.trainer_precision): the trained weights, their
    gradients and AdamW's two moments in fp32 (`master_bytes`), whatever the compute dtype;
    frozen weights (LoRA's base) and the full fine-tuning's KL reference in `frozen_bytes`
    (bf16 on GPUs, as load_policy loads them; fp32 on the CPU)."""
    trainable = c.lora if lora else c.params
    frozen = c.params if lora else 0
    weights = (frozen * frozen_bytes + trainable * master_bytes) / shards
    grads = trainable * master_bytes / shards
    optimizer = 2 * trainable * master_bytes / shards
    reference = 0.0 if lora or not kl else c.params * frozen_bytes / shards
    per_layer = act.lm_per_token_layer * tokens
    per_block = act.vision_per_patch_block * patches
    if checkpointing:
        activations = act.lm_boundary_per_token * tokens * layers
        activations += act.vision_boundary_per_patch * patches * depth
    else:
        activations = per_layer * layers + per_block * depth
    # The backward pass holds one layer's activation gradients beside what is kept (and,
    # under checkpointing, that layer's recomputed activations: one more layer).
    activations += max(per_layer, per_block) * (2 if checkpointing else 1)
    activations += act.base_per_token * tokens
    # The response logits and their softmax, kept for the backward pass; while the loss's
    # backward runs, their gradients are as large again.
    activations += 2 * act.logits_per_position_vocab * sequences * (response + 1) * vocab
    return Plan(weights, grads, optimizer, reference, activations)


def step_size(geometry: ImageGeometry) -> tuple[int, int]:
    """Tokens and vision patches of one step: SCREENS screenshots of SCREEN plus text."""
    w, h = geometry.model_size(width=SCREEN[0], height=SCREEN[1])
    patches = (w // 14) * (h // 14)
    return TEXT_TOKENS + RESPONSE_TOKENS + SCREENS * patches // 4, SCREENS * patches


def plan_table() -> None:
    tokens, patches = step_size(QWEN25_VL)
    print(f"one step: {SCREENS} screenshots at {SCREEN[0]}x{SCREEN[1]} = {tokens} tokens, "
          f"{patches} vision patches\n")  # fmt: skip
    print("| model | mode | precision | checkpointing | shards | weights | grads | optimizer | "
          "reference | activations | total GB | fits 80 GB |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, shape in SHAPES.items():
        c = counts(config_of(shape["text"], tie=shape["tie"], vision=VISION))
        layers, depth = shape["text"]["num_hidden_layers"], VISION["depth"]
        for dtype in (torch.bfloat16, torch.float32):
            size = torch.finfo(dtype).bits // 8
            for lora in (True, False):
                act = measure_activations(shape, dtype=dtype, lora=lora)
                for checkpointing in (False, True):
                    for shards in (1, 2, 4, 8):
                        if lora and shards > 1:
                            continue  # LoRA on one GPU (replicas, not shards, add GPUs)
                        p = plan(c, act, layers=layers, depth=depth, lora=lora, frozen_bytes=size,
                                 checkpointing=checkpointing, shards=shards, tokens=tokens,
                                 patches=patches,
                                 vocab=shape["text"]["vocab_size"])  # fmt: skip
                        print(
                            f"| {name} ({c.params / 1e9:.2f}B) | "
                            f"{'LoRA r16' if lora else 'full'} | "
                            f"{'bf16 compute, fp32 master' if size == 2 else 'fp32'} | "
                            f"{'on' if checkpointing else 'off'} | {shards} | "
                            f"{p.weights / GB:.1f} | {p.grads / GB:.1f} | "
                            f"{p.optimizer / GB:.1f} | {p.reference / GB:.1f} | "
                            f"{p.activations / GB:.1f} | {p.total / GB:.1f} | "
                            f"{'yes' if p.total <= FITS else 'no'} |",
                            flush=True,
                        )


# ------------------------------------------------------------------ the real check


MID = {"text": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936},
       "tie": False}  # fmt: skip
MID_VISION = {"depth": 8, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16}


def rss() -> int:
    return int(_status("VmRSS")) * 1024


def peak() -> int:
    return int(_status("VmHWM")) * 1024


def _status(field: str) -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split()[1]
    raise RuntimeError(field)


def validate_child(workdir: Path) -> None:
    """In a fresh process: a real LoRA update of the mid-size model; print measured vs plan."""
    from core.samples import TrainSample
    from training.config import CurationConfig, TrainerConfig
    from training.trainer import PolicyTrainer

    torch.set_num_threads(2)
    checkpoint = workdir / "mid"
    samples = [
        TrainSample(step_id=i, trajectory_id=i, group_id=i // 2,
                    messages=[{"role": "user", "content": [
                        {"type": "text", "text": "Click the red button. " * 40},
                        {"type": "image_url", "image_url": {"url": _data_url(448, 336)}}]}],
                    response_text="Action: click(start_box='(100,200)')" * 4,
                    reward=float(i % 2), rollout_logprobs=[], mean_entropy=1.0,
                    policy_version=0)
        for i in range(4)
    ]  # fmt: skip
    gc.collect()
    before = rss()
    torch.manual_seed(0)
    settings = TrainerConfig(lr=1e-4, kl_coef=0.1, micro_batch=4, lora_rank=LORA.rank,
                             lora_alpha=LORA.alpha)  # fmt: skip
    trainer = PolicyTrainer(config=settings, start_checkpoint=checkpoint, run_dir=workdir / "run")
    loaded = rss()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak: the load's own is not ours
    curation = CurationConfig(high_entropy=False, truncated_is=False)
    started = time.monotonic()
    for _ in range(2):  # the optimizer's moments exist from the first step on
        trainer.update(samples, curation)
    seconds = (time.monotonic() - started) / 2
    measured = peak() - before
    from core.encoding import encode_batch, response_token_ids

    batch = encode_batch(
        trainer.policy,
        [s.messages for s in samples],
        responses=[response_token_ids(trainer.policy, s.response_text) for s in samples],
    )
    tokens = int(batch.attention_mask.sum())
    patches = int(batch.image_grid_thw.prod(-1).sum()) if batch.image_grid_thw is not None else 0
    c = counts(trainer.policy.model.get_base_model().config)
    act = measure_activations({**MID, "text": MID["text"]}, dtype=torch.float32, lora=True)
    p = plan(c, act, layers=MID["text"]["num_hidden_layers"], depth=MID_VISION["depth"],
             lora=True, frozen_bytes=4, checkpointing=False, shards=1, tokens=tokens,
             patches=patches, vocab=MID["text"]["vocab_size"], sequences=4,
             response=int(batch.response_mask.sum(1).max()))  # fmt: skip
    print(
        f"mid-size model: {c.params / 1e9:.2f}B parameters, LoRA r{LORA.rank} "
        f"({c.lora / 1e6:.1f}M), fp32, CPU; one update of 4 steps ({tokens} tokens)"
    )
    print(f"loaded weights (RSS after load - before): {(loaded - before) / GB:.2f} GB")
    print("| | weights | grads | optimizer | activations | total GB |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| planned | {p.weights / GB:.2f} | {p.grads / GB:.3f} | {p.optimizer / GB:.3f} | "
        f"{p.activations / GB:.2f} | {p.total / GB:.2f} |"
    )
    print(
        f"| measured peak RSS during the updates - RSS before load | | | | | {measured / GB:.2f} |"
    )
    print(f"plan / measured = {p.total / measured:.2f}; {seconds:.1f} s per update")


def _data_url(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 60, 60)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def build_mid(workdir: Path) -> None:
    from training.tiny_policy import build_tiny_policy

    build_tiny_policy(
        workdir / "mid", arch="qwen2_5_vl", hidden=MID["text"]["hidden_size"],
        layers=MID["text"]["num_hidden_layers"], heads=MID["text"]["num_attention_heads"],
        kv_heads=MID["text"]["num_key_value_heads"],
        intermediate=MID["text"]["intermediate_size"], vision_hidden=MID_VISION["hidden_size"],
        vision_depth=MID_VISION["depth"], vision_heads=MID_VISION["num_heads"],
        model_vocab=MID["text"]["vocab_size"],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--validate", action="store_true", help="also the real LoRA update")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        validate_child(Path(args.child))
        return
    plan_table()
    if args.validate:
        with tempfile.TemporaryDirectory() as tmp:
            build_mid(Path(tmp))
            subprocess.run([sys.executable, __file__, "--child", tmp], check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


if __name__ == "__main__":
    main()
