"""The vision tower's attention in one call per block, whatever the number of windows.

Qwen2.5-VL's vision blocks attend within 112 px windows (64 patches) and, in a few blocks,
within each whole image; Qwen3-VL's attend within each image. transformers runs such
variable-length attention as one kernel call per window or image on every implementation
but flash-attention's varlen kernel: a 1920x1080 screenshot has about 170 windows, so a step
of five screenshots through a 32-block tower is about 27,000 calls, each too small to keep a
GPU busy or to amortise the CPU's dispatch.

`use_packed_vision_attention(model)` registers `packed_varlen_attention` with transformers'
`AttentionInterface` and selects it for the vision tower only. transformers hands an
implementation whose name contains "flash" the packed sequence and its boundaries
(`cu_seq_lens_q`); this one pads the windows into one batch and makes one
`scaled_dot_product_attention` call (flash-attention's varlen kernel instead, on CUDA in
half precision where the `flash_attn` package is installed). The padded keys are masked, so
the result equals the per-window loop (tests/core/test_vision_attention.py: fp32, max abs
difference under 1e-5), and it is differentiable (pretraining trains the tower through it).

    from core.vision_attention import use_packed_vision_attention
    use_packed_vision_attention(policy.model)      # load_policy does this
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACKED_ATTENTION = "dartboard_flash_packed"
"""The registered name. transformers routes by the word "flash" in it: that is what makes the
vision attention pass the packed sequence with its boundaries instead of looping."""

REFERENCE_ATTENTION = "sdpa"
"""transformers' own: one SDPA call per window (the reference the tests compare against)."""


def packed_varlen_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: Tensor | None = None,
    cu_seq_lens_k: Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    is_causal: bool = False,
    **_: Any,
) -> tuple[Tensor, None]:
    """Attention within each of the packed sequences that `cu_seq_lens_q` delimits.

    query, key, value: [1, H, S, D] (S = all patches, sequences back to back);
    cu_seq_lens_q: [n + 1] cumulative boundaries, 0 first and S last (zero-length entries
    allowed). Returns ([1, S, H, D], None), the layout transformers' attention functions
    return. Non-causal only (the vision tower's); `attention_mask` must be None.
    """
    if attention_mask is not None or is_causal:
        raise ValueError("packed_varlen_attention is for the vision tower: non-causal, no mask")
    if cu_seq_lens_q is None:
        raise ValueError("packed_varlen_attention needs cu_seq_lens_q (the sequence boundaries)")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_q, cu_seq_lens_k):
        raise ValueError("packed_varlen_attention needs the same boundaries for queries and keys")
    if _flash_varlen_usable(query):
        return _flash_varlen(query, key, value, cu_seq_lens_q, scaling, dropout), None
    return _padded_sdpa(query, key, value, cu_seq_lens_q, scaling, dropout), None


def _padded_sdpa(
    query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scaling: float | None, dropout: float
) -> Tensor:
    """The sequences padded to the longest one, as a batch: one SDPA call. The padded keys are
    masked out; padded query rows are computed and dropped (every row keeps a real key, so no
    row is all -inf). Sequences of one length (every window of a screen but its edges, or
    every image of a step) need no mask at all."""
    bounds = cu.tolist()
    starts = bounds[:-1]
    lengths = [b - a for a, b in zip(starts, bounds[1:], strict=True)]
    kept = [(s, n) for s, n in zip(starts, lengths, strict=True) if n > 0]
    total = query.shape[2]
    if len(kept) == 1:
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, scale=scaling
        )  # [1, H, S, D]
        return out.transpose(1, 2)
    longest = max(n for _, n in kept)
    device = query.device
    offsets = torch.arange(longest, device=device)
    start_t = torch.tensor([s for s, _ in kept], device=device)
    length_t = torch.tensor([n for _, n in kept], device=device)
    valid = offsets[None, :] < length_t[:, None]  # [n, L]
    index = torch.where(valid, start_t[:, None] + offsets[None, :], 0)  # [n, L]

    def pack(t: Tensor) -> Tensor:  # [1, H, S, D] -> [n, H, L, D]
        return t[0][:, index].permute(1, 0, 2, 3)

    mask = None if bool(valid.all()) else valid[:, None, None, :]  # [n, 1, 1, L]: keys kept
    out = F.scaled_dot_product_attention(
        pack(query), pack(key), pack(value), attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [n, H, L, D]
    out = out.transpose(1, 2)[valid]  # [S, H, D], the sequences back to back
    if out.shape[0] != total:
        raise ValueError(f"cu_seq_lens_q covers {out.shape[0]} of {total} packed positions")
    return out[None]


def _flash_varlen_usable(query: Tensor) -> bool:
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("flash_attn") is not None
    )


def _flash_varlen(
    query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scaling: float | None, dropout: float
) -> Tensor:
    # Imported here: flash_attn is an optional GPU package, loaded only when a GPU pass runs.
    from flash_attn import flash_attn_varlen_func

    cu32 = cu.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    out = flash_attn_varlen_func(
        query[0].transpose(0, 1),  # [S, H, D]
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu32,
        cu32,
        longest,
        longest,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=False,
    )
    return out[None]


def _register() -> None:
    # transformers' AttentionInterface is a process-wide mapping; registering twice is harmless.
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_varlen_attention)


def use_packed_vision_attention(model: nn.Module) -> None:
    """Run `model`'s vision tower (Qwen2-VL family) with one attention call per block; the
    language model keeps its own implementation. A model without a vision config is left as
    it is."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return
    _register()
    model.set_attn_implementation({"vision_config": PACKED_ATTENTION})  # type: ignore[operator]


def use_reference_vision_attention(model: nn.Module) -> None:
    """transformers' own per-window loop (SDPA): the reference, and what checkpoints record."""
    if getattr(getattr(model, "config", None), "vision_config", None) is not None:
        model.set_attn_implementation({"vision_config": REFERENCE_ATTENTION})  # type: ignore[operator]
