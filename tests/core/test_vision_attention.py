"""The vision tower's packed attention: one call per block, the same output as transformers'
per-window loop, and gradients that agree too."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from core.vision_attention import (
    PACKED_ATTENTION,
    packed_varlen_attention,
    use_packed_vision_attention,
    use_reference_vision_attention,
)


def windowed_model() -> Qwen2_5_VLForConditionalGeneration:
    """A narrow Qwen2.5-VL: 4 vision blocks, the second and last with full attention."""
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
                     "max_window_layers": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                         "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                       "out_hidden_size": 64, "fullatt_block_indexes": [1, 3]},
        image_token_id=2, video_token_id=3, vision_start_token_id=4, vision_end_token_id=5,
    )  # fmt: skip
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def patches(grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random flattened patches for images of these (t, h, w) patch grids."""
    grid = torch.tensor(grids)
    n = int(grid.prod(-1).sum())
    return torch.randn(n, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)), grid


def vision_out(model, pixels, grid, *, packed: bool) -> torch.Tensor:
    (use_packed_vision_attention if packed else use_reference_vision_attention)(model)
    return model.model.visual(pixels, grid_thw=grid).pooler_output


# Two screens whose sides are not multiples of the 8-patch window, so edge windows are short
# and the padded batch needs its mask; one image, so the full-attention blocks need none.
@pytest.mark.parametrize("grids", [[(1, 22, 30), (1, 14, 10)], [(1, 16, 16)]])
def test_packed_attention_equals_the_per_window_loop(grids):
    model = windowed_model()
    pixels, grid = patches(grids)
    with torch.no_grad():
        reference = vision_out(model, pixels, grid, packed=False)
        packed = vision_out(model, pixels, grid, packed=True)
    assert packed.shape == reference.shape
    assert (packed - reference).abs().max().item() <= 1e-5


def test_packed_attention_gradients_equal_the_reference():
    model = windowed_model().train()
    pixels, grid = patches([(1, 12, 18), (1, 10, 6)])
    grads = []
    for packed in (False, True):
        model.zero_grad()
        vision_out(model, pixels, grid, packed=packed).square().sum().backward()
        grads.append(model.model.visual.blocks[0].attn.qkv.weight.grad.clone())
    assert (grads[0] - grads[1]).abs().max().item() <= 1e-4 * grads[0].abs().max().item()


def attention_calls(model, pixels, grid, *, packed: bool) -> int:
    (use_packed_vision_attention if packed else use_reference_vision_attention)(model)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model.model.visual(pixels, grid_thw=grid)
    return sum(
        e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention"
    )


def test_one_attention_call_per_block_whatever_the_windows():
    model = windowed_model()
    pixels, grid = patches([(1, 22, 30), (1, 14, 10)])
    depth = model.config.vision_config.depth
    assert attention_calls(model, pixels, grid, packed=True) == depth
    # The loop it replaces: one call per window in the two windowed blocks (22x30 patches are
    # 3x4 windows of 8x8, 14x10 are 2x2) and one per image in the two full blocks.
    assert attention_calls(model, pixels, grid, packed=False) == 2 * (12 + 4) + 2 * 2


def test_the_tiny_qwen3_vl_policy_loads_with_packed_attention(tiny_policy_dir):
    from core.policy import load_policy

    policy = load_policy(tiny_policy_dir)
    assert policy.model.config.vision_config._attn_implementation == PACKED_ATTENTION
    assert policy.model.config.text_config._attn_implementation == "sdpa"


def test_a_mask_or_causal_call_is_refused_with_the_reason():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="non-causal, no mask"):
        packed_varlen_attention(None, q, q, q, is_causal=True, cu_seq_lens_q=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="needs cu_seq_lens_q"):
        packed_varlen_attention(None, q, q, q)
