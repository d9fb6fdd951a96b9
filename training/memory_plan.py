"""The memory a run's trainer needs on one GPU, planned from the checkpoint's own config and
the run's budgets, and the settings that make it fit.

    .venv/bin/python -c "from training.memory_plan import *; print(plan_for_checkpoint('policies/tiny-grounded'))"

What one trainer process holds (`training.trainer`: fp32 master weights, gradients and AdamW
moments of what trains; frozen weights and the KL reference in the compute dtype):

- weights: the trained parameters in fp32, the frozen ones (LoRA's base) in bf16 on a GPU;
  divided by the shards under FSDP2;
- gradients and AdamW's two moments: fp32, of the trained parameters, divided by the shards;
- the KL reference: a second copy in bf16 under full fine-tuning (under LoRA it is the same
  weights with the adapters off);
- activations: what autograd keeps for the backward pass of one micro-batch, per token and
  decoder layer (and per vision patch and block when the vision tower trains), elements
  times bytes per element. The per-token counts were measured on this CPU with a
  saved-tensor hook at four widths (`bench/realsize.py`'s probe) and fit exactly by
  8h + 4i + 2kv for a decoder layer (h the hidden width, i the MLP's, kv the key/value
  width), 6.3h + 4i + 2kv under LoRA, and 13v + 4vi for a vision block; attention is linear
  in memory (flash or memory-efficient kernels). Bytes per element: 4 in fp32 (the CPU),
  2.27 under bf16 autocast, from the H200's full fine-tuning peak (docs/gpu-and-vllm.md).
  With gradient checkpointing a layer keeps its input only, plus one layer's activations
  while it is recomputed. On the CPU, attention keeps each head's T x T weights per
  sequence too. The response logits are kept in fp32 (log-softmax and its
  gradient), per response token and vocabulary entry.

`TrainerRequest.plan` picks gradient checkpointing and the micro-batch's token budget (`auto`, the
defaults) so that the total stays under the GPU's memory less `HEADROOM_GIB`, and raises
`DoesNotFit` with the numbers and what would fit when nothing does. Checked against the GPU
peaks in docs/gpu-and-vllm.md and against CPU peaks at two shapes
(tests/training/test_memory_plan.py). Torch-free: the web process plans at run create.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core.imaging import QWEN_MERGE, QWEN_PATCH, ImageGeometry, ProcessorNotSupported
from training.config import TrainerConfig

GIB = 1024**3
HEADROOM_GIB = 4.0  # the CUDA context and the allocator's slack, besides the plan
# Elements autograd keeps per token, per decoder layer / per patch, per vision block.
LM_ELEMENTS = (8.0, 4.0, 2.0)  # x (hidden, intermediate, key/value width)
LM_ELEMENTS_LORA = (6.3, 4.0, 2.0)
VISION_ELEMENTS = (13.0, 4.0)  # x (vision hidden, vision intermediate)
LOGIT_ELEMENTS = 3.0  # fp32 logits, their log-softmax and its gradient, per vocabulary entry
BYTES_BF16_AUTOCAST = 2.27  # per kept element under bf16 autocast (H200 measurement)
BYTES_FP32 = 4.0
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # core.lora.LANGUAGE_TARGETS


class DoesNotFit(ValueError):
    """No setting left at `auto` makes the trainer fit the GPU; the message has the numbers."""


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads from a checkpoint's config.json (and its weights' headers)."""

    params: int  # every parameter
    vision_params: int
    hidden: int
    intermediate: int
    layers: int
    kv_width: int  # key/value heads x head width
    heads: int
    vocab: int
    vision_hidden: int
    vision_intermediate: int
    vision_depth: int
    merge: int  # vision patches per image token (spatial_merge_size squared)

    @property
    def lora_width(self) -> int:
        """Sum of (in + out) over the LoRA-targeted projections: adapters = rank x this."""
        h, i, kv = self.hidden, self.intermediate, self.kv_width
        per_layer = (h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h)
        return per_layer * self.layers

    @classmethod
    def from_config(cls, config: dict[str, Any], *, params: int | None = None) -> ModelShape:
        """From a Qwen2-VL / Qwen2.5-VL / Qwen3-VL config.json; `params`: the exact count
        (from the weights' headers) where the weights are at hand, else counted here."""
        text = config.get("text_config") or config
        vision = config.get("vision_config") or {}
        h = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or h // heads)
        kv = int(text.get("num_key_value_heads") or heads) * head_dim
        i = int(text["intermediate_size"])
        layers = int(text["num_hidden_layers"])
        vocab = int(text["vocab_size"])
        vh = int(vision.get("hidden_size") or vision.get("embed_dim") or 0)
        vi = int(vision.get("intermediate_size") or vh * float(vision.get("mlp_ratio", 4)))
        depth = int(vision.get("depth") or 0)
        merge = int(vision.get("spatial_merge_size") or QWEN_MERGE) ** 2
        # Qwen2.5-VL's vision MLP is gated (three matrices), Qwen2-VL's and Qwen3-VL's two.
        mlp = 3 if config.get("model_type") == "qwen2_5_vl" else 2
        mergers = 1 + len(vision.get("deepstack_visual_indexes") or ())
        patch = int(vision.get("patch_size") or QWEN_PATCH)
        pixels = int(vision.get("in_channels") or 3) * int(vision.get("temporal_patch_size") or 2)
        vision_params = (
            depth * (4 * vh * vh + mlp * vh * vi)
            + pixels * patch * patch * vh
            + int(vision.get("num_position_embeddings") or 0) * vh
            + mergers * merge * vh * (merge * vh + h)
        )
        if params is None:
            tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings")))
            attention = h * heads * head_dim * 2 + 2 * h * kv
            per_layer = attention + 3 * h * i + 2 * h
            params = vocab * h * (1 if tied else 2) + layers * per_layer + vision_params
        return cls(
            params=params,
            vision_params=vision_params,
            hidden=h,
            intermediate=i,
            layers=layers,
            kv_width=kv,
            heads=heads,
            vocab=vocab,
            vision_hidden=vh,
            vision_intermediate=vi,
            vision_depth=depth,
            merge=merge,
        )


def checkpoint_shape(path: str | Path) -> ModelShape | None:
    """A checkpoint directory's shape, its parameters counted from the safetensors headers
    (exact, no tensor read) where they are there; None when it has no config.json here (an
    artifact reference, fetched later) or one the plan does not read."""
    root = Path(path)
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    params = sum(_safetensors_params(f) for f in sorted(root.glob("*.safetensors"))) or None
    try:
        return ModelShape.from_config(config, params=params)
    except (KeyError, TypeError, ValueError):
        return None


def _safetensors_params(path: Path) -> int:
    """Parameters in one safetensors file, from its JSON header alone."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")


@dataclass(frozen=True)
class Sample:
    """The largest training step the run's budgets allow: prompt and reply tokens (images
    counted as their image tokens) and the vision patches of its images."""

    tokens: int
    reply: int
    patches: int

    @classmethod
    def of_budgets(
        cls,
        shape: ModelShape,
        *,
        max_prompt_tokens: int,
        max_new_tokens: int,
        max_images: int,
        image_tokens: int,
    ) -> Sample:
        """The run's budgets (`rollout.*`); `image_tokens`: the most one image becomes (the
        processor's max_pixels over its patch factor squared)."""
        shown = min(max_images * image_tokens, max_prompt_tokens)
        return cls(
            tokens=max_prompt_tokens + max_new_tokens,
            reply=max_new_tokens,
            patches=shown * shape.merge,
        )


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes one trainer process holds at its peak, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    reference: float
    activations: float
    checkpointing: bool
    micro_batch_tokens: int

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.reference + self.activations

    def describe(self) -> str:
        parts = [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("AdamW", self.optimizer),
            ("KL reference", self.reference),
            ("activations", self.activations),
        ]
        shown = ", ".join(f"{name} {value / GIB:.1f}" for name, value in parts if value)
        return f"{self.total / GIB:.1f} GiB ({shown})"


def trainer_memory(
    shape: ModelShape,
    *,
    lora_rank: int,
    lora_vision: bool = False,
    kl: bool,
    shards: int = 1,
    checkpointing: bool,
    micro_batch_tokens: int,
    sample: Sample,
    cuda: bool,
) -> TrainerMemory:
    """The peak of one update whose micro-batches hold `micro_batch_tokens` tokens (at least
    one `sample`), each micro-batch's patches and replies in the sample's proportion."""
    tokens = max(micro_batch_tokens, sample.tokens)
    sequences = max(1, tokens // sample.tokens)
    patches = sample.patches * tokens / sample.tokens
    frozen_bytes = 2 if cuda else 4
    per = BYTES_BF16_AUTOCAST if cuda else BYTES_FP32
    if lora_rank:
        trained = lora_rank * shape.lora_width
        frozen = shape.params
        vision_trains = lora_vision
    else:
        trained, frozen, vision_trains = shape.params, 0, True
    weights = (frozen * frozen_bytes + trained * 4) / shards
    gradients = trained * 4 / shards
    optimizer = 2 * trained * 4 / shards
    reference = shape.params * frozen_bytes / shards if kl and not lora_rank else 0.0
    a, b, c = LM_ELEMENTS_LORA if lora_rank else LM_ELEMENTS
    layer = (a * shape.hidden + b * shape.intermediate + c * shape.kv_width) * tokens
    va, vb = VISION_ELEMENTS
    block = (va * shape.vision_hidden + vb * shape.vision_intermediate) * patches
    block = block if vision_trains else 0.0
    if checkpointing:
        kept = float(shape.hidden * tokens * shape.layers)
        kept += shape.vision_hidden * patches * shape.vision_depth if vision_trains else 0
        kept += max(layer, block)  # the layer being recomputed
    else:
        kept = layer * shape.layers + block * shape.vision_depth
    if not cuda:
        # On the CPU, attention under autograd keeps each head's T x T weights per sequence
        # (measured: the peaks of packed and of padded updates both need it); GPUs' flash and
        # memory-efficient kernels keep O(T).
        square = shape.heads * sample.tokens**2 * sequences
        kept += square if checkpointing else square * shape.layers
    logits = LOGIT_ELEMENTS * sequences * (sample.reply + 1) * shape.vocab * 4
    return TrainerMemory(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        reference=reference,
        activations=kept * per + logits,
        checkpointing=checkpointing,
        micro_batch_tokens=tokens,
    )


@dataclass(frozen=True)
class TrainerRequest:
    """What a run's trainer asks of one GPU: the model, its largest step, its settings (None:
    `auto`, the plan picks)."""

    shape: ModelShape
    sample: Sample
    lora_rank: int
    lora_vision: bool
    kl: bool
    shards: int
    checkpointing: bool | None
    micro_batch_tokens: int | None
    max_samples: int = 8  # whole steps in a micro-batch at most (trainer.micro_batch)

    @classmethod
    def of(cls, config: TrainerConfig, *, shape: ModelShape, sample: Sample) -> TrainerRequest:
        switch = config.gradient_checkpointing
        return cls(
            shape=shape,
            sample=sample,
            lora_rank=config.lora_rank,
            lora_vision=config.lora_vision,
            kl=config.kl_coef > 0,
            shards=config.replicas if config.shard == "on" and config.replicas > 1 else 1,
            checkpointing=None if switch == "auto" else switch == "on",
            micro_batch_tokens=config.micro_batch_tokens or None,
            max_samples=config.micro_batch,
        )

    def plan(self, gpu_gib: float) -> TrainerMemory:
        """The plan on a GPU of `gpu_gib`: the settings left at None are picked, the fastest
        first (checkpointing off, then on; the largest micro-batch, in whole steps of the
        largest size, up to max_samples), so the total stays under `gpu_gib - HEADROOM_GIB`.

        Raises:
            DoesNotFit: with the settings given, nothing left to pick fits; the message gives
                the plan's numbers and the changes that would fit.
        """
        budget = (gpu_gib - HEADROOM_GIB) * GIB
        tried: TrainerMemory | None = None
        for checkpoint in (False, True) if self.checkpointing is None else (self.checkpointing,):
            sizes = [self.micro_batch_tokens] if self.micro_batch_tokens else self._sizes()
            for size in sizes:
                memory = self.memory(checkpointing=checkpoint, micro_batch_tokens=size)
                if memory.total <= budget:
                    return memory
                tried = memory
        assert tried is not None
        raise DoesNotFit(_does_not_fit(self, tried, gpu_gib=gpu_gib))

    def _sizes(self) -> list[int]:
        """Micro-batch budgets to try, largest first: max_samples whole steps, halved to 1."""
        sizes, n = [], self.max_samples
        while n >= 1:
            sizes.append(self.sample.tokens * n)
            n //= 2
        return sizes if sizes[-1] == self.sample.tokens else [*sizes, self.sample.tokens]

    def memory(self, *, checkpointing: bool, micro_batch_tokens: int) -> TrainerMemory:
        return trainer_memory(
            self.shape,
            lora_rank=self.lora_rank,
            lora_vision=self.lora_vision,
            kl=self.kl,
            shards=self.shards,
            checkpointing=checkpointing,
            micro_batch_tokens=micro_batch_tokens,
            sample=self.sample,
            cuda=True,
        )


def fits(request: TrainerRequest, gpu_gib: float) -> bool:
    try:
        request.plan(gpu_gib)
    except DoesNotFit:
        return False
    return True


def trainer_layout(
    config: TrainerConfig,
    request: TrainerRequest | None,
    *,
    gpu_gib: float | None,
    gpus: int,
) -> tuple[int, bool]:
    """(replicas, sharded) of a run's trainer, its `auto` settings decided for a cluster
    whose largest GPU has `gpu_gib` (None: the trainer runs on the CPU, or its model is not
    on this disk) and which has `gpus` GPUs in all.

    replicas 0 (auto) is one replica, but under full fine-tuning on GPUs: the fewest sharded
    replicas (1, 2, 4, ... up to `gpus`) whose plan fits one GPU; where none does, one
    (run create refuses such a run with the plan's numbers). shard auto is on where the
    replicas would not fit a GPU unsharded."""
    on_gpu = request is not None and gpu_gib is not None
    if config.replicas:
        replicas = config.replicas
        if config.shard != "auto" or replicas == 1:
            return replicas, config.shard == "on" and replicas > 1
        if config.lora_rank or not on_gpu:
            return replicas, False
        assert request is not None and gpu_gib is not None
        return replicas, not fits(replace(request, shards=1), gpu_gib)
    if config.lora_rank or not on_gpu or config.shard == "off":
        return 1, False
    assert request is not None and gpu_gib is not None
    replicas = 1
    while replicas <= min(gpus, 64):
        if fits(replace(request, shards=replicas), gpu_gib):
            return replicas, replicas > 1
        replicas *= 2
    return 1, False


def _does_not_fit(request: TrainerRequest, least: TrainerMemory, *, gpu_gib: float) -> str:
    """What the smallest plan needs and, of the usual ways out, which would fit."""
    budget = (gpu_gib - HEADROOM_GIB) * GIB
    ways = []
    smallest = replace(request, checkpointing=True, micro_batch_tokens=request.sample.tokens)
    if not request.lora_rank:
        for shards in (2, 4, 8, 16, 32, 64):
            option = replace(smallest, shards=shards).memory(
                checkpointing=True, micro_batch_tokens=request.sample.tokens
            )
            if shards > request.shards and option.total <= budget:
                ways.append(
                    f"trainer.replicas {shards} with trainer.shard on ({option.total / GIB:.0f} "
                    "GiB per GPU)"
                )
                break
        option = replace(smallest, lora_rank=16, shards=1).memory(
            checkpointing=True, micro_batch_tokens=request.sample.tokens
        )
        if option.total <= budget:
            ways.append(f"LoRA (trainer.lora_rank 16: {option.total / GIB:.0f} GiB)")
    sample = request.sample
    ways.append(
        f"shorter steps (rollout.max_prompt_tokens, rollout.max_images: one step is "
        f"{sample.tokens:,} tokens)"
    )
    mode = f"LoRA rank {request.lora_rank}" if request.lora_rank else "full fine-tuning"
    sharded = f", sharded over {request.shards} GPUs" if request.shards > 1 else ""
    return (
        f"the trainer needs {least.describe()} per GPU for this {request.shape.params / 1e9:.1f}"
        f"B-parameter model ({mode}{sharded}, "
        f"{'with' if least.checkpointing else 'without'} gradient checkpointing, one step of "
        f"{sample.tokens:,} tokens a micro-batch); the largest GPU has {gpu_gib:.0f} GiB "
        f"({HEADROOM_GIB:.0f} kept for CUDA). Would fit: {'; or '.join(ways)}"
    )


def budget_sample(
    policy_dir: str | Path, *, max_prompt_tokens: int, max_new_tokens: int, max_images: int
) -> Sample | None:
    """The largest step of a run with these budgets (`rollout.*`) on the policy at
    `policy_dir`, its images at the processor's largest size; None when the directory lacks
    the config or the processor's (an artifact reference, fetched later)."""
    shape = checkpoint_shape(policy_dir)
    try:
        geometry = ImageGeometry.from_policy_dir(policy_dir)
    except (ProcessorNotSupported, OSError, ValueError):
        return None
    if shape is None:
        return None
    return Sample.of_budgets(
        shape,
        max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=max_new_tokens,
        max_images=max_images,
        image_tokens=geometry.max_pixels // geometry.factor**2,
    )


def inference_bytes(shape: ModelShape, *, context_tokens: int, sequences: int) -> float:
    """What one inference worker holds on a GPU: the weights in bf16 and the KV cache of
    `sequences` requests of `context_tokens` (keys and values, bf16, every decoder layer).
    vLLM takes its configured share of the GPU whatever this says, but refuses to start when
    that share holds less than the weights and one request's cache (`vllm_fits`)."""
    kv_per_token = 2 * shape.layers * shape.kv_width * 2
    return shape.params * 2 + kv_per_token * context_tokens * sequences


def vllm_fits(shape: ModelShape, *, context_tokens: int, share_gib: float) -> str | None:
    """Why vLLM with `share_gib` of a GPU cannot serve one request of `context_tokens`
    (its weights and that request's KV cache), or None when it can."""
    needed = inference_bytes(shape, context_tokens=context_tokens, sequences=1)
    if needed <= share_gib * GIB:
        return None
    return (
        f"vLLM's share of the GPU ({share_gib:.0f} GiB) holds less than the weights and one "
        f"request's KV cache at {context_tokens:,} tokens ({needed / GIB:.1f} GiB)"
    )


def run_trainer_request(
    policy_dir: str | Path,
    config: TrainerConfig,
    *,
    max_prompt_tokens: int,
    max_new_tokens: int,
    max_images: int,
) -> TrainerRequest | None:
    """What a run's trainer asks of a GPU: the policy at `policy_dir` (its start checkpoint:
    the shape does not change as it trains) at the run's budgets (`rollout.*`); None where
    its config or processor is not on this disk."""
    shape = checkpoint_shape(policy_dir)
    sample = budget_sample(
        policy_dir,
        max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=max_new_tokens,
        max_images=max_images,
    )
    if shape is None or sample is None:
        return None
    return TrainerRequest.of(config, shape=shape, sample=sample)
