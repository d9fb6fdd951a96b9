"""FSDP2 sharding of a full fine-tuning trainer over its replicas (`training.replicas`): each
decoder layer and vision block, then the whole model, is `fully_shard`ed, so every replica
holds 1/N of the weights, gradients and AdamW state and gathers a layer's weights only
while it runs. Gradients are reduce-scattered as sums (the update's losses are already
normalised over the whole step, as for unsharded replicas): FSDP averages them, so
`Replicas.sum_gradients` multiplies its shards by N (a divide factor of 1 would need
PREMUL_SUM, which gloo lacks).

On GPUs with bf16 the shards are gathered in bf16 for compute and gradients reduced in fp32,
while the shards themselves (the optimizer's master weights) stay fp32 (FSDP2's
`MixedPrecisionPolicy`): an all-gather then moves half the bytes of an fp32 one.

Every function here is collective: all replicas call it, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_model(model: nn.Module, *, compute_dtype: torch.dtype | None = None) -> None:
    """Shard every repeated block (decoder layers, vision blocks), then the rest; inner
    blocks before the blocks that hold them, as FSDP2 requires. `compute_dtype` (bf16 on
    GPUs): weights gathered in it for the forward and backward passes, gradients reduced in
    fp32; None gathers the shards' own dtype."""
    mp = MixedPrecisionPolicy()
    if compute_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for module in reversed(list(model.modules())):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on the CPU (every replica gets them; the leader writes them)."""
    return dict(get_model_state_dict(model, options=FULL))  # type: ignore[arg-type]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return get_optimizer_state_dict(model, optimizer, options=FULL)


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Each replica keeps its shard of a full optimizer state saved by `full_optimizer_state`."""
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=FULL)
