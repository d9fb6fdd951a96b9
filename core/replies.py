"""Where a reply ends and what its text is: one answer for both inference backends and for
the history of the next turn.

A checkpoint names its end tokens in up to three places: config.json's `eos_token_id` (or
its text_config's), generation_config.json's `eos_token_id` (Qwen2.5-VL and UI-TARS-1.5 list
<|im_end|> and <|endoftext|> there) and its tokenizer's eos token. `stop_token_ids` takes
them all, with <|im_end|>, the chat template's end of turn: the transformers server stops
at them, and the vLLM adapter asks vLLM to (vLLM started with `--generation-config vllm`
would otherwise stop at the config's one token and write on past <|endoftext|>).

`reply_text` turns a reply's token ids (its stop token left out) into the text the policy
wrote, special tokens kept (<|box_start|> is part of an answer), and drops a character the
token limit cut in half: its first bytes alone decode to U+FFFD, which the next turn's
history would then carry. Both backends return this text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TURN_END = "<|im_end|>"
CUT_CHARACTER = "\ufffd"  # what the first bytes of a multi-byte character decode to


def stop_token_ids(checkpoint: str | Path, tokenizer: Any) -> list[int]:
    """Every end token `checkpoint` (a full model directory) and its tokenizer name, sorted."""
    ids = set(_config_end_tokens(str(checkpoint)))
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    turn_end = tokenizer.convert_tokens_to_ids(TURN_END)
    if isinstance(turn_end, int) and turn_end != tokenizer.unk_token_id:
        ids.add(turn_end)
    return sorted(ids)


@functools.lru_cache(maxsize=32)
def _config_end_tokens(checkpoint: str) -> tuple[int, ...]:
    """The end tokens a checkpoint's config files name: read once per directory (a
    generation asks for them on every batch)."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, list):
            for item in value:
                add(item)

    for name in ("config.json", "generation_config.json"):
        try:
            data = json.loads((Path(checkpoint) / name).read_text())
        except (OSError, ValueError):
            continue
        add(data.get("eos_token_id"))
        add((data.get("text_config") or {}).get("eos_token_id"))
    return tuple(sorted(ids))


def reply_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text of a reply's tokens (its stop token already left out): special tokens kept,
    a character cut in half by the token limit dropped."""
    text = str(tokenizer.decode(list(token_ids), skip_special_tokens=False))
    return text.rstrip(CUT_CHARACTER)
