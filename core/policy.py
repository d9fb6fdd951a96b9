"""Loading and saving a policy: model, tokenizer, image processor and chat template.

    policy = load_policy("policies/tiny-grounded")        # or a LoRA adapter directory
    save_checkpoint(policy, "checkpoints/run-1/v3")
    load_weights_into(policy, "checkpoints/run-1/v4")    # in place, same architecture
    staged = stage_weights(policy, "checkpoints/run-1/v5")  # beside the live weights...
    install_weights(policy, staged)                      # ...swapped in between forward passes

Works for the tiny policy (Qwen3-VL architecture, patch 14) and for any local Qwen2-VL /
Qwen2.5-VL checkpoint (e.g. UI-TARS-1.5-7B); nothing is downloaded. Released Qwen3-VL
checkpoints use 16 px patches (32 px per image token); rollout maps coordinates with the
geometry the processor reports (`Policy.image_geometry`, `core.imaging`), whatever its factor.
The rollout workers and the trainer encode prompts with `core.encoding` and sample and score
with `core.generation`, so both tokenize alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from core.imaging import ImageGeometry
from core.lora import (
    ADAPTER_WEIGHTS,
    adapter_base,
    attach_adapter,
    check_adapter_shape,
    is_adapter_dir,
    is_peft_model,
    set_adapter_weights,
)
from core.prompt_counter import chat_template_of
from core.vision_attention import use_packed_vision_attention

_MODEL_CLASSES: dict[str, Any] = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}


@dataclass
class Policy:
    """A loaded policy: model, tokenizer, image processor and chat template."""

    model: PreTrainedModel  # or a peft PeftModel around one (LoRA: `core.lora`)
    tokenizer: Any
    image_processor: Qwen2VLImageProcessorPil
    chat_template: str
    path: Path  # the directory loaded: a full checkpoint or an adapter
    base: Path | None = None  # the base checkpoint under the weights (path itself when full)

    def __post_init__(self) -> None:
        if self.base is None:
            self.base = self.path

    @property
    def has_adapter(self) -> bool:
        return is_peft_model(self.model)

    def token_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"tokenizer at {self.path} has no token {token!r}")
        return int(tid)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def image_geometry(self) -> ImageGeometry:
        """The image processor's geometry: rollout maps coordinates with it."""
        return ImageGeometry.from_processor_config(
            self.image_processor.to_dict(), where=f"{self.path}/preprocessor_config.json"
        )


def load_policy(
    path: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None
) -> Policy:
    """Load a Qwen2-VL / Qwen2.5-VL directory (tiny policy or e.g. UI-TARS-1.5-7B), locally;
    or a LoRA adapter directory (`core.lora`): its base, then the adapter attached.

    dtype defaults to float32 on CPU and bfloat16 elsewhere.
    """
    path = Path(path)
    if is_adapter_dir(path):
        policy = load_policy(adapter_base(path), device=device, dtype=dtype)
        policy.model = attach_adapter(policy.model, path)  # type: ignore[assignment]
        policy.model.eval()
        policy.path = path
        return policy
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    model_type = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    if model_type not in _MODEL_CLASSES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not one of {sorted(_MODEL_CLASSES)}"
        )
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # No device_map: weights go to one device here (sharding is the trainer's business).
    model = _MODEL_CLASSES[model_type].from_pretrained(path, local_files_only=True, dtype=dtype)
    model.to(device).eval()
    # The vision tower's windows in one attention call per block (`core.vision_attention`):
    # the same outputs as transformers' per-window loop, for the trainer and the server alike.
    use_packed_vision_attention(model)
    # Sampling is Dartboard's alone (core.generation): the checkpoint's generation_config.json
    # (Qwen2.5-VL-7B-Instruct's top_k=1, repetition_penalty=1.05) would otherwise fill every
    # field generate() leaves unset. Only its token ids are kept.
    shipped = model.generation_config
    model.generation_config = GenerationConfig(
        bos_token_id=shipped.bos_token_id,
        eos_token_id=shipped.eos_token_id,
        pad_token_id=shipped.pad_token_id,
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    # The PIL image processor: the default one needs torchvision, which has no CPU build here.
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    return Policy(
        model=model,
        tokenizer=tokenizer,
        image_processor=image_processor,
        chat_template=chat_template_of(path),
        path=path,
    )


def save_checkpoint(
    policy: Policy, out_dir: str | Path, *, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write weights, tokenizer, image processor and chat template; loadable by load_policy.
    `state_dict`: the weights to write when the model holds only a shard of them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(out, state_dict=state_dict)  # config.json names no attention
    policy.tokenizer.save_pretrained(out)
    policy.image_processor.save_pretrained(out)
    (out / "chat_template.json").write_text(
        json.dumps({"chat_template": policy.chat_template}, indent=2) + "\n"
    )
    return out


@dataclass
class StagedWeights:
    """Weights loaded beside the live ones, ready for `install_weights` to swap in.

    `tensors` are by the live model's parameter names (the plain model's for "full", the
    peft model's for "adapter"), already in each parameter's dtype and on its device, except
    for an adapter directory's (`adapter_dir`), which keep the file's names for peft."""

    kind: Literal["full", "adapter"]
    tensors: dict[str, torch.Tensor]
    source: str  # where they came from, for logs and replies
    path: Path | None = None  # the directory they were read from (None: pulled over the network)
    adapter_dir: Path | None = None  # a LoRA adapter directory: peft maps and attaches it


@torch.no_grad()
def load_weights_into(policy: Policy, checkpoint_dir: str | Path) -> None:
    """Copy the weights of `checkpoint_dir` (same architecture) into policy.model in place:
    `stage_weights` then `install_weights`, for a caller with no one generating meanwhile."""
    install_weights(policy, stage_weights(policy, checkpoint_dir))


@torch.no_grad()
def stage_weights(policy: Policy, checkpoint_dir: str | Path) -> StagedWeights:
    """Load `checkpoint_dir`'s weights beside the live ones without touching the model (so
    generation goes on meanwhile). An adapter directory stages only the adapter (`core.lora`).

    A full checkpoint is loaded through from_pretrained (which maps saved key names to module
    names) on the CPU, in the live weights' dtype, then moved to their device: peak memory is
    one extra copy of the weights. Raises ValueError when the architectures differ.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if is_adapter_dir(checkpoint_dir):
        return _stage_adapter(policy, checkpoint_dir)
    model: PreTrainedModel = (
        policy.model.get_base_model() if is_peft_model(policy.model) else policy.model  # type: ignore[assignment]
    )
    live = next(model.parameters())
    fresh = type(model).from_pretrained(  # type: ignore[attr-defined]
        checkpoint_dir, local_files_only=True, dtype=live.dtype
    )
    if fresh.config.to_dict() != model.config.to_dict():
        diff = _config_diff(fresh.config.to_dict(), model.config.to_dict())
        if diff:
            raise ValueError(f"{checkpoint_dir} has another architecture: {diff}")
    tensors = {name: p.detach().to(live.device) for name, p in fresh.named_parameters()}
    return StagedWeights("full", tensors, str(checkpoint_dir), path=checkpoint_dir)


@torch.no_grad()
def install_weights(policy: Policy, staged: StagedWeights) -> None:
    """Swap `staged` in. Call where no forward pass runs meanwhile (the server's generation
    thread, between batches): full weights and pulled adapters swap pointers (microseconds a
    tensor), an adapter directory is copied into the live adapter (megabytes). Raises
    ValueError, before changing anything, when the names do not fit the model.

    A full checkpoint after an adapter drops the adapter first."""
    if staged.adapter_dir is not None:
        _install_adapter(policy, staged)
        return
    if staged.kind == "full" and is_peft_model(policy.model):  # full weights after adapters
        policy.model = policy.model.unload()
    live = dict(policy.model.named_parameters())
    wanted = set(live) if staged.kind == "full" else {n for n in live if "lora_" in n}
    if set(staged.tensors) != wanted:
        missing, unexpected = (
            sorted(wanted - set(staged.tensors)),
            sorted(set(staged.tensors) - wanted),
        )
        raise ValueError(
            f"{staged.source}: weights do not match the model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, tensor in staged.tensors.items():
        if tensor.shape != live[name].shape or tensor.dtype != live[name].dtype:
            raise ValueError(f"{staged.source}: {name} is {tensor.dtype}{list(tensor.shape)}")
    for name, tensor in staged.tensors.items():
        live[name].data = tensor
    if staged.path is not None:
        policy.path = policy.base = staged.path


def _stage_adapter(policy: Policy, adapter_dir: Path) -> StagedWeights:
    """An adapter directory's weights, read; the base must be the one the adapter was trained
    on, and a live adapter must have its shape (rank, targets)."""
    from safetensors.torch import load_file

    base = adapter_base(adapter_dir).resolve()
    assert policy.base is not None
    if base != policy.base.resolve():
        raise ValueError(
            f"{adapter_dir} adapts {base}, but this policy's base is {policy.base.resolve()}"
        )
    if policy.has_adapter:
        check_adapter_shape(policy.model, adapter_dir)  # type: ignore[arg-type]
    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    return StagedWeights(
        "adapter", tensors, str(adapter_dir), path=adapter_dir, adapter_dir=adapter_dir
    )


def _install_adapter(policy: Policy, staged: StagedWeights) -> None:
    """Copy a staged adapter directory into the live adapter, or attach it to the plain base."""
    assert staged.adapter_dir is not None
    if policy.has_adapter:
        set_adapter_weights(policy.model, staged.tensors, where=staged.source)  # type: ignore[arg-type]
    else:
        policy.model = attach_adapter(policy.model, staged.adapter_dir).eval()  # type: ignore[assignment]
    policy.path = staged.adapter_dir


def _config_diff(a: dict, b: dict) -> list[str]:
    ignore = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"}
    return [k for k in sorted(set(a) | set(b)) if k not in ignore and a.get(k) != b.get(k)]
