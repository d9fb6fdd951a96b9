"""The language model's attention over packed rows: each sequence of a row attended on its
own, causally, instead of the whole row under a block-diagonal mask.

The trainer packs a micro-batch's sequences into one row without padding
(`core.generation.packed_logprobs`): position ids that restart at 0 at each sequence, and no
attention mask. transformers then builds a block-diagonal causal mask for SDPA and eager
(`masking_utils.find_packed_sequence_indices`), which is exact, but the kernel still computes
every query against every key of the row: (sum of lengths)^2 scores where the sequences need
the sum of their squares, which made packing slower than padding on the CPU
(docs/benchmarks.md, *Packed micro-batches*).

`use_packed_text_attention(model)` registers `packed_causal_attention` with transformers'
`AttentionInterface` and selects it for the language model only. On a packed row (one row
whose text position ids restart, queries and keys the same tokens) it runs SDPA once per
sequence with `is_causal`; on anything else (a padded batch, generation with a cache) it is
transformers' SDPA, called with the same arguments, so the results are SDPA's. The
block-diagonal mask transformers builds for a packed row goes unused (one boolean [L, L]).

    from core.text_attention import use_packed_text_attention
    use_packed_text_attention(trainer_model)      # PolicyTrainer does this when it packs
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn

PACKED_TEXT_ATTENTION = "dartboard_packed_sdpa"
"""The registered name; its masks are SDPA's (`masking_utils.sdpa_mask`)."""


def packed_bounds(position_ids: Tensor | None, *, rows: int, length: int) -> list[int] | None:
    """Where the sequences of a packed row start, and its length last: [0, s1, ..., L], from
    the text position ids [1, L] (a sequence starts where a position is not the one before
    plus 1, as transformers finds them). None when the input is not a packed row of several
    sequences: more than one row, no position ids, or positions that never restart."""
    if position_ids is None or rows != 1 or position_ids.shape[-1] != length:
        return None
    positions = position_ids.reshape(-1)
    starts = (positions[1:] != positions[:-1] + 1).nonzero()[:, 0] + 1
    if starts.numel() == 0:
        return None
    return [0, *starts.tolist(), length]


def packed_causal_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    position_ids: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """SDPA attention, one call per sequence on a packed row.

    query: [B, H, Lq, D]; key, value: [B, Hkv, Lk, D]; position_ids: the text positions
    [B, Lq] the decoder layers pass. Returns ([B, Lq, H, D], None), the layout transformers'
    attention functions return."""
    # Imported here, not at module level: transformers' integrations load on first use.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = None
    if query.shape[2] == key.shape[2]:  # no cache: the queries are the keys' tokens
        bounds = packed_bounds(position_ids, rows=query.shape[0], length=query.shape[2])
    if bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    outputs = [
        sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            is_causal=True,
            **kwargs,
        )[0]
        for start, end in itertools.pairwise(bounds)
    ]
    return torch.cat(outputs, dim=1), None


def _register() -> None:
    # transformers' interfaces are process-wide mappings; registering twice is harmless.
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_TEXT_ATTENTION, packed_causal_attention)
    AttentionMaskInterface.register(PACKED_TEXT_ATTENTION, sdpa_mask)


def use_packed_text_attention(model: nn.Module) -> None:
    """Run `model`'s language model (Qwen2-VL family, a transformers model, not a peft
    wrapper) with `packed_causal_attention`; the vision tower keeps its own."""
    _register()
    model.set_attn_implementation({"text_config": PACKED_TEXT_ATTENTION})  # type: ignore[operator]
