"""The prompt builder: image window, order, the token budget's drop order, and the Qwen
chat-template form (the counter's agreement with the server: tests/core/test_prompt_counter.py)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from core.imaging import QWEN25_VL
from core.prompt_counter import PromptCounter
from core.prompts import (
    DEFAULT_SYSTEM_PROMPT,
    HistoryTurn,
    build_messages,
    decode_image_parts,
    image_part,
)
from training.tiny_policy import TINY_GEOMETRY

BOUND = PromptCounter.bound(QWEN25_VL)  # text at one token per byte: costs easy to follow


def png(width: int, height: int, shade: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def episode(n_turns: int) -> tuple[list[HistoryTurn], list[bytes]]:
    """n earlier turns and n + 1 distinct screenshots (the last is the current screen)."""
    history = [
        HistoryTurn(thought=f"step {i}", action_text=f"click(start_box='({i},{i})')")
        for i in range(n_turns)
    ]
    screenshots = [png(20 + i, 30, shade=i) for i in range(n_turns + 1)]
    return history, screenshots


def assistant_texts(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "assistant"]


def test_keeps_the_last_k_screenshots_in_order_and_every_turn_text() -> None:
    history, screenshots = episode(8)
    messages = build_messages(
        instruction="Book a flight", history=history, screenshots=screenshots, max_images=5
    )
    assert messages[0] == {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
    assert messages[1] == {"role": "user", "content": "Book a flight"}
    assert decode_image_parts(messages) == screenshots[-5:]
    assert messages[-1] == {"role": "user", "content": [image_part(screenshots[-1])]}
    assert assistant_texts(messages) == [
        f"Thought: step {i}\nAction: click(start_box='({i},{i})')" for i in range(8)
    ]
    # Each of the last 4 turns' screenshots comes right before that turn's text.
    for i in range(4, 8):
        text_at = messages.index({"role": "assistant", "content": history[i].text})
        assert messages[text_at - 1] == {"role": "user", "content": [image_part(screenshots[i])]}
    # Older turns are text only: their assistant messages follow each other.
    roles = [m["role"] for m in messages]
    assert roles[:6] == ["system", "user", "assistant", "assistant", "assistant", "assistant"]


def test_accepts_only_the_last_screenshots() -> None:
    history, screenshots = episode(8)
    full = build_messages(instruction="x", history=history, screenshots=screenshots)
    tail = build_messages(instruction="x", history=history, screenshots=screenshots[-5:])
    assert tail == full
    fewer = build_messages(instruction="x", history=history, screenshots=screenshots[-2:])
    assert decode_image_parts(fewer) == screenshots[-2:]
    assert len(assistant_texts(fewer)) == 8


def test_first_turn_is_instruction_and_current_screen() -> None:
    screen = png(160, 210)
    messages = build_messages(instruction="Click OK", history=[], screenshots=[screen])
    assert [m["role"] for m in messages] == ["system", "user", "user"]
    assert decode_image_parts(messages) == [screen]


def test_a_tiny_budget_keeps_instruction_and_current_screen() -> None:
    history, screenshots = episode(6)
    messages = build_messages(
        instruction="Book a flight",
        history=history,
        screenshots=screenshots,
        max_prompt_tokens=1,
        counter=BOUND,
    )
    assert messages == [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": "Book a flight"},
        {"role": "user", "content": [image_part(screenshots[-1])]},
    ]


def test_the_budget_drops_the_oldest_screenshots_first_then_the_oldest_texts() -> None:
    history, screenshots = episode(6)  # 5 images: turns 2-5 and the current screen

    def build(budget: int | None) -> list[dict]:
        return build_messages(
            instruction="go",
            history=history,
            screenshots=screenshots,
            max_prompt_tokens=budget,
            counter=BOUND,
        )

    whole = (
        BOUND.text(role="system", text=DEFAULT_SYSTEM_PROMPT)
        + BOUND.text(role="user", text="go")
        + BOUND.reply
        + sum(BOUND.text(role="assistant", text=turn.text) for turn in history)
        + sum(BOUND.image(png) for png in screenshots[2:])
    )
    assert build(whole) == build(None)
    # Turn 2's screenshot goes, then turn 3's; every text stays.
    one_fewer = whole - BOUND.image(screenshots[2])
    messages = build(one_fewer)
    assert assistant_texts(messages) == [turn.text for turn in history]
    assert decode_image_parts(messages) == screenshots[3:]
    messages = build(one_fewer - 1)
    assert assistant_texts(messages) == [turn.text for turn in history]
    assert decode_image_parts(messages) == screenshots[4:]
    # No earlier screenshot left: then the oldest texts go, the current screen stays.
    texts_only = whole - sum(BOUND.image(png) for png in screenshots[2:-1])
    first_text = BOUND.text(role="assistant", text=history[0].text)
    messages = build(texts_only - first_text)
    assert assistant_texts(messages) == [turn.text for turn in history[1:]]
    assert decode_image_parts(messages) == screenshots[-1:]
    assert assistant_texts(build(texts_only - 1)) == [turn.text for turn in history[1:]]
    assert assistant_texts(build(texts_only)) == [turn.text for turn in history]


def test_a_budget_needs_the_policys_counter() -> None:
    history, screenshots = episode(1)
    with pytest.raises(ValueError, match="needs the policy's PromptCounter"):
        build_messages(
            instruction="x", history=history, screenshots=screenshots, max_prompt_tokens=99
        )


def test_images_cost_the_tokens_of_the_policys_geometry() -> None:
    frame = BOUND.image(png(28, 28)) - 4  # a 28x28 screen is min_pixels: 4 image tokens
    assert BOUND.image(png(160, 210)) - frame == 48  # 168x224 model image, 6x8 tokens
    tiny = PromptCounter.bound(TINY_GEOMETRY)
    assert tiny.image(png(800, 600)) - frame == 234  # 504x364: 18x13


def test_history_turn_text_and_from_output() -> None:
    turn = HistoryTurn.from_output("Thought: go on\nAction: wait()")
    assert turn == HistoryTurn(thought="go on", action_text="wait()")
    assert turn.text == "Thought: go on\nAction: wait()"
    assert HistoryTurn.from_output("rambling without an action").text == (
        "Thought: rambling without an action"
    )
    assert HistoryTurn(thought="", action_text="wait()").text == "Action: wait()"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"screenshots": []}, "needs at least one screenshot"),
        ({"screenshots": [b"a", b"b"]}, "got 2 screenshots for 0 history turns; at most 1"),
        ({"screenshots": [b"a"], "max_images": 0}, "max_images must be at least 1"),
    ],
)
def test_bad_arguments_say_what_is_wrong(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_messages(instruction="x", history=[], **kwargs)


def test_image_parts_must_be_base64_data_urls() -> None:
    bad_url = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
    ]
    with pytest.raises(ValueError, match=r"must be a base64 data:image/\.\.\. URL"):
        decode_image_parts(bad_url)


def test_history_drops_chat_structure_tokens() -> None:
    turn = HistoryTurn.from_output("Thought: a<|image_pad|>b<|im_start|>\nAction: wait()<|im_end|>")
    assert turn.thought == "ab" and turn.action_text == "wait()"
