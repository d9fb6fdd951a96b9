"""Where a reply ends and what its text is (`core.replies`), for a checkpoint with Qwen2.5-VL's
end tokens: the one answer both backends and the next turn's history use."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from core.replies import reply_text, stop_token_ids
from training.tiny_policy import build_tiny_policy


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    out = build_tiny_policy(tmp_path_factory.mktemp("q25") / "m", arch="qwen2_5_vl",
                            hidden=64, layers=1, intermediate=128, vision_hidden=32)  # fmt: skip
    return out, AutoTokenizer.from_pretrained(out)


def test_every_end_token_the_checkpoint_names_stops_a_reply(qwen25, tmp_path):
    path, tok = qwen25
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # config.json names only <|im_end|>; generation_config.json both, as the released model
    assert json.loads((path / "config.json").read_text())["text_config"]["eos_token_id"] == im_end
    assert stop_token_ids(path, tok) == sorted([im_end, endoftext])
    bare = shutil.copytree(path, tmp_path / "bare")
    (bare / "generation_config.json").unlink()  # a checkpoint saved without one
    assert stop_token_ids(bare, tok) == [im_end]


def test_a_character_cut_by_the_token_limit_is_left_out_of_the_text(qwen25):
    _, tok = qwen25
    ids = tok.encode("点击 <|box_start|>(3,4)<|box_end|>", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    assert reply_text(tok, ids[:cut]) == tok.decode(ids[:cut]).rstrip("\ufffd")
    assert "\ufffd" not in reply_text(tok, ids[:cut])
    assert reply_text(tok, ids) == "点击 <|box_start|>(3,4)<|box_end|>"  # special tokens kept
