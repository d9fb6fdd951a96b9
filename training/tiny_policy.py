"""Build the tiny CPU policy: a Qwen3-VL-architecture model (Qwen2.5-VL optional) with random
weights and a tokenizer trained here, saved as a normal Hugging Face directory that `load_policy` loads.

    .venv/bin/python -c "from training.tiny_policy import build_tiny_policy; \
        print(build_tiny_policy('var/policies/tiny'))"

Nothing is downloaded: the tokenizer is a byte-level BPE trained with the `tokenizers`
library over a corpus of UI-TARS-style outputs generated in this module. Digits are split
one per token, so a coordinate `(123,45)` is the digit sequence a real Qwen tokenizer makes.

Image budget (Qwen2-VL `smart_resize`, patch 14, merge 2, so one image token = 28x28 px):
`min_pixels` = 4 tokens, `max_pixels` = 256 tokens. A 160x210 MiniWoB screenshot becomes
168x224 px = 48 image tokens; a 1024x768 desktop is scaled to 504x364 px = 234 tokens, which
keeps a 5-screenshot context under ~1.2k tokens for the tiny model on CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from core.imaging import QWEN_MERGE, QWEN_PATCH, ImageGeometry
from core.prompt_counter import QWEN2_VL_CHAT_TEMPLATE

TINY_GEOMETRY = ImageGeometry.from_tokens(
    min_tokens=4, max_tokens=256, factor=QWEN_PATCH * QWEN_MERGE
)
"""The processor the tiny policy is built with; everything else reads it back from the
checkpoint's preprocessor_config.json (`core.imaging.ImageGeometry.from_policy_dir`)."""

# Order fixes the ids: <|endoftext|> is 0 (pad), <|im_end|> is 2 (eos).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The Qwen2-VL chat template (as shipped with Qwen2-VL / UI-TARS), minus nothing.
_WORD_TEXT = (
    "click the button submit ok cancel search box text field enter type select option menu "
    "checkbox radio tab link item list scroll down up left right drag slider date next "
    "previous close open file edit view window page form input password username email "
    "login sign in out name first last number value color shape circle square triangle red "
    "blue green yellow black white large small top bottom middle center find then and "
    "with from to of on at is it a an this that I need should now will see found task done "
    "screen desktop terminal browser settings save copy paste delete undo home start"
)
_WORDS = _WORD_TEXT.split()
_ACTIONS = (
    "click(start_box='{p}')",
    "left_double(start_box='{p}')",
    "right_single(start_box='{p}')",
    "drag(start_box='{p}', end_box='{q}')",
    "hotkey(key='{k}')",
    "type(content='{t}')",
    "scroll(start_box='{p}', direction='{d}')",
    "wait()",
    "finished(content='{t}')",
    "call_user()",
)
_KEYS = ("enter", "ctrl c", "ctrl v", "ctrl a", "tab", "esc", "backspace", "alt f4")


def _corpus(*, rng: random.Random, lines: int) -> list[str]:
    """UI-TARS-style outputs and instructions, the text the tiny tokenizer is fitted to."""

    def sentence(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def point() -> str:
        return f"<|box_start|>({rng.randint(0, 1023)},{rng.randint(0, 767)})<|box_end|>"

    out = [" ".join(_WORDS), "0123456789 ,.:;!?'\"()[]{}<>=+-*/_\\|@#$%&~`^\n\t"]
    for _ in range(lines):
        action = rng.choice(_ACTIONS).format(
            p=point(),
            q=point(),
            k=rng.choice(_KEYS),
            t=sentence(rng.randint(1, 4)),
            d=rng.choice(("up", "down", "left", "right")),
        )
        thought = sentence(rng.randint(3, 15)).capitalize() + "."
        out.append(f"Thought: {thought}\nAction: {action}")
        out.append(f"Instruction: {sentence(rng.randint(3, 12))}.")
    return out


def _train_tokenizer(*, seed: int, vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Digits first, one per pre-token, so no merge can join two digits.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng=random.Random(seed), lines=4000), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=32768,
    )


def build_tiny_policy(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 1024,
    vision_hidden: int = 128,
    vision_depth: int = 2,
    vision_heads: int = 4,
    vocab_size: int = 2048,
    rope_theta: float = 1_000_000.0,
    temporal_section: int | None = None,
    arch: str = "qwen3_vl",
    vision_positions: int = 576,
    model_vocab: int | None = None,
    fullatt_blocks: tuple[int, ...] | None = None,
    init_device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    geometry: ImageGeometry = TINY_GEOMETRY,
) -> Path:
    """Write a random-weight vision-language model (~6M params by default) plus tokenizer,
    image processor config and chat template to `out_dir`; return the directory.

    `model_vocab` sizes the embedding and output layers past the tokenizer's vocabulary (a
    real model's 152k, for memory benchmarks); by default they match the tokenizer.
    `fullatt_blocks` (Qwen2.5-VL): the vision blocks that attend over whole images, the
    others within 112 px windows; by default the last block (the released 7B: 7, 15, 23, 31);
    () for none (every block within windows: a full-HD screen costs the CPU little).
    `init_device` and `dtype`: where the random weights are drawn and how they are saved (a
    7B-shaped model is drawn on a GPU in bf16 in seconds; on the CPU in fp32, minutes).
    `geometry`: the image processor's bounds (`core.imaging.QWEN25_VL` for a checkpoint that
    sees screens as UI-TARS-1.5 does; its factor must be the patch times the merge, 28).

    `arch` is "qwen3_vl" (default) or "qwen2_5_vl". Both keep patch 14 and a 2x2 merge (one
    image token = 28x28 px, so rollout's coordinate mapping is the same). What differs is
    where an image token's position lives: Qwen2.5-VL's vision tower has only rotary
    positions, which shape attention scores but never reach the token's features, so the
    text model can find the target token but cannot read off where it is (measured: it does
    not ground; docs/benchmarks.md "Tiny policy grounding"). Qwen3-VL's vision tower adds a learned
    absolute position table (`vision_positions` entries, a square grid resampled to each
    image) to the patches, and its text rope interleaves the time/height/width frequencies.

    `hidden / heads` is the text head_dim; its half is split over Qwen's three mrope
    sections (temporal, height, width) in the 1:1.5:1.5 ratio of the released models, or,
    with `temporal_section`, that many frequencies for time and the rest halved between
    height and width. Qwen's sections take the frequencies in order (time the fastest,
    width the slowest): with the released rope_theta (1e6) and a tiny head_dim, the width
    rotations over a 6x8 image grid are ~1e-4 rad, so the text model cannot tell columns
    apart by position; a small `rope_theta` gives height and width usable frequencies.

    Long because it spells out the tiny model's whole configuration (text, vision,
    tokenizer) as one literal.
    """
    head_dim = hidden // heads
    if hidden % heads or head_dim % 8:
        raise ValueError(f"hidden ({hidden}) / heads ({heads}) must be a multiple of 8")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)

    tokenizer = _train_tokenizer(seed=seed, vocab_size=vocab_size)
    ids: dict[str, int] = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}  # type: ignore[arg-type]
    if geometry.factor != QWEN_PATCH * QWEN_MERGE:
        raise ValueError(
            f"geometry.factor must be {QWEN_PATCH * QWEN_MERGE}, got {geometry.factor}"
        )
    if arch not in ("qwen3_vl", "qwen2_5_vl"):
        raise ValueError(f"arch must be 'qwen3_vl' or 'qwen2_5_vl', got {arch!r}")
    half = head_dim // 2
    if temporal_section is None and arch == "qwen3_vl":
        # Qwen3-VL's released split [24, 20, 20] of 64 frequencies, scaled to `half`.
        side = (half - 3 * half // 8) // 2
        mrope = [half - 2 * side, side, side]
    elif temporal_section is None:
        mrope = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    else:
        if not 0 < temporal_section < half or (half - temporal_section) % 2:
            raise ValueError(
                f"temporal_section ({temporal_section}) must be in (0, {half}) and leave an "
                "even number of frequencies for height and width"
            )
        side = (half - temporal_section) // 2
        mrope = [temporal_section, side, side]
    text: dict[str, Any] = {
        "vocab_size": model_vocab or len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": rope_theta,
            "mrope_section": mrope,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision: dict[str, Any] = {
        "depth": vision_depth,
        "hidden_size": vision_hidden,
        "intermediate_size": 2 * vision_hidden,
        "num_heads": vision_heads,
        "out_hidden_size": hidden,
        # The processor's geometry (its factor) is this patch times this merge.
        "patch_size": QWEN_PATCH,
        "spatial_merge_size": QWEN_MERGE,
    }
    special: dict[str, Any] = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    model: PreTrainedModel
    if arch == "qwen3_vl":
        text["head_dim"] = head_dim
        text["tie_word_embeddings"] = False
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(num_position_embeddings=vision_positions, deepstack_visual_indexes=[0])
        with torch.device(init_device):
            model = Qwen3VLForConditionalGeneration._from_config(
                Qwen3VLConfig(
                    text_config=text, vision_config=vision, tie_word_embeddings=False, **special
                ),
                dtype=dtype,
            )
    else:
        text["max_window_layers"] = layers
        last = (vision_depth - 1,)
        vision["fullatt_block_indexes"] = list(last if fullatt_blocks is None else fullatt_blocks)
        with torch.device(init_device):
            model = Qwen2_5_VLForConditionalGeneration._from_config(
                Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special), dtype=dtype
            )
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    geometry.processor().save_pretrained(out)
    # Processor-level copy, where Qwen2-VL / UI-TARS checkpoints keep their template.
    (out / "chat_template.json").write_text(
        json.dumps({"chat_template": QWEN2_VL_CHAT_TEMPLATE}, indent=2) + "\n"
    )
    return out
