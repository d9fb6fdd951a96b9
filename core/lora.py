"""LoRA adapters (peft) on a Qwen-VL policy: which modules get them, and how an adapter
directory is written, attached and swapped in place.

An adapter version is a peft directory (`adapter_config.json` + `adapter_model.safetensors`,
megabytes) whose `base_model_name_or_path` is the absolute path of the base checkpoint.
`core.policy.load_policy` loads one as base + adapter; `load_weights_into` swaps a new
adapter's weights into a live model without touching the base, so a sync ships the adapter
only.

Targets: the language model's attention and MLP projections by default; with `vision`, the
vision tower's linear layers too (otherwise it stays frozen, like every base weight).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:  # torch and peft (which pulls in transformers' model code) cost seconds
    # of CPU: imported where used, so a process that only reads a LoraSpec (an env worker)
    # never loads them
    from peft import LoraConfig, PeftModel
    from torch import nn
    from transformers import PreTrainedModel

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# peft full-matches a string target against each module's dotted name.
LANGUAGE_TARGETS = (
    r".*\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
)
VISION_TARGETS = r".*\.visual\..*\.(qkv|proj|linear_fc1|linear_fc2|gate_proj|up_proj|down_proj)"


@dataclass(frozen=True)
class LoraSpec:
    """The adapters a run trains (rank 0 would be full fine-tuning: no spec)."""

    rank: int
    alpha: int
    vision: bool = False  # adapters on the vision tower too

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")

    def config(self, base: Path) -> LoraConfig:
        from peft import LoraConfig

        targets = f"({LANGUAGE_TARGETS})|({VISION_TARGETS})" if self.vision else LANGUAGE_TARGETS
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=0.0,  # pi_old and the training pass must agree exactly
            target_modules=targets,
            bias="none",
            base_model_name_or_path=str(base.resolve()),
        )


def add_adapters(model: nn.Module, spec: LoraSpec, *, base: Path) -> PeftModel:
    """Wrap `model` (loaded from `base`) with fresh, trainable adapters; base weights freeze.
    lora_B starts at zero, so the wrapped model computes exactly what the base did."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, spec.config(base))  # type: ignore[arg-type]
    if not any(p.requires_grad for p in peft_model.parameters()):
        raise ValueError(f"no module of {base} matches the LoRA targets")
    return peft_model


def is_peft_model(model: object) -> TypeGuard[PeftModel]:
    """Whether `model` is wrapped by peft, without importing peft: a process that never
    attached an adapter never imported it, and holds no peft model."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (or the model itself)."""
    # Imported here for start-up cost, as at the top of this module.
    from transformers import PreTrainedModel

    base = model.get_base_model() if is_peft_model(model) else model
    assert isinstance(base, PreTrainedModel)
    return base


def is_adapter_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def adapter_base(path: str | Path) -> Path:
    """The base checkpoint an adapter directory was trained on."""
    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(
            f"{path}: the adapter's base checkpoint {base!r} is not a model directory here"
        )
    return Path(base)


def attach_adapter(model: nn.Module, path: str | Path, *, trainable: bool = False) -> PeftModel:
    """`model` (the adapter's base) with the adapter of `path` attached."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(path), is_trainable=trainable)  # type: ignore[arg-type]


def swap_adapter(model: PeftModel, path: str | Path) -> None:
    """Copy the adapter weights of `path` into `model`'s live adapter, in place. Raises
    ValueError when the adapter's shape (rank, targets) differs from the live one."""
    from safetensors.torch import load_file

    check_adapter_shape(model, path)
    set_adapter_weights(model, load_file(str(Path(path) / ADAPTER_WEIGHTS)), where=str(path))


def check_adapter_shape(model: PeftModel, path: str | Path) -> None:
    """Raise ValueError when the adapter of `path` has another rank, alpha or targets than
    `model`'s live one."""
    from peft import LoraConfig

    live = model.peft_config["default"]
    new = LoraConfig.from_pretrained(str(path))
    for field in ("r", "lora_alpha", "target_modules"):
        if getattr(live, field) != getattr(new, field):
            raise ValueError(
                f"{path}: adapter {field} {getattr(new, field)!r} differs from the live "
                f"adapter's {getattr(live, field)!r}"
            )


def set_adapter_weights(model: PeftModel, state: dict, *, where: str) -> None:
    """Copy an adapter file's tensors (`state`, as peft saves them) into the live adapter."""
    import torch
    from peft import set_peft_model_state_dict

    with torch.no_grad():
        result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise ValueError(f"{where}: adapter weights do not fit ({unexpected[:3]})")
