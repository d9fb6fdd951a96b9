"""The prompt counter against the server's own count (`core.encoding.prompt_token_count`,
what `rollout.server` refuses by and what its `prompt_token_ids` hold): equal to the token
for the shipped policy and a Qwen2.5-VL checkpoint with UI-TARS-1.5's template and geometry,
on histories where characters / 4 is far off (digits, CJK, code), so a budget is met to the
token; its byte bound never counts less."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
from PIL import Image

from core.encoding import prompt_token_count, to_qwen_messages
from core.imaging import QWEN25_VL
from core.policy import Policy, load_policy
from core.prompt_counter import PromptCounter
from core.prompts import PROMPT_TEMPLATES, HistoryTurn, PromptTemplate, build_messages
from training.tiny_policy import build_tiny_policy

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "policies" / "tiny-grounded"

TURNS = [
    HistoryTurn(thought="Open the form.", action_text="click(start_box='(1203,457)')"),
    HistoryTurn(thought="输入用户名和密码，然后登录。", action_text="type(content='管理员')"),
    HistoryTurn(thought="", action_text="type(content='def f(x):\\n    return {x: [x*2]}\\n')"),
    HistoryTurn(thought="Scroll 3141592653 times", action_text="scroll(direction='down')"),
    HistoryTurn(thought="  leading spaces\n\nand blank lines  ", action_text="wait()"),
]


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (20, 90, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def shipped() -> tuple[Policy, PromptCounter]:
    return load_policy(SHIPPED), PromptCounter.from_policy_dir(SHIPPED)


@pytest.fixture(scope="module")
def ui_tars(tmp_path_factory) -> tuple[Policy, PromptCounter]:
    """A Qwen2.5-VL checkpoint that sees screens as UI-TARS-1.5 does (its geometry)."""
    path = build_tiny_policy(
        tmp_path_factory.mktemp("q25") / "policy",
        arch="qwen2_5_vl",
        hidden=64,
        heads=2,
        kv_heads=1,
        layers=1,
        intermediate=128,
        vision_hidden=32,
        vision_heads=2,
        geometry=QWEN25_VL,
    )
    return load_policy(path), PromptCounter.from_policy_dir(path)


def server_count(policy: Policy, messages: list[dict]) -> int:
    qwen, images = to_qwen_messages(messages)
    return prompt_token_count(policy, qwen, images)


@pytest.mark.parametrize(
    ("which", "template", "screen"),
    [
        ("shipped", PROMPT_TEMPLATES["dartboard"], (160, 210)),
        ("shipped", PromptTemplate("t", "Ünïcode system: 日本語", "{instruction}"), (800, 600)),
        ("ui_tars", PROMPT_TEMPLATES["ui-tars-1.5"], (1920, 1080)),
    ],
)
def test_a_budget_is_met_to_the_token_of_the_servers_count(
    request, which: str, template: PromptTemplate, screen: tuple[int, int]
) -> None:
    policy, counter = request.getfixturevalue(which)
    screens = [png(screen[0] - 7 * i, screen[1]) for i in range(len(TURNS) + 1)]

    def build(budget: int | None) -> list[dict]:
        return build_messages(
            instruction="Log in as 管理员 with PIN 0042, then open {settings}.",
            history=TURNS,
            screenshots=screens,
            max_images=3,
            template=template,
            max_prompt_tokens=budget,
            counter=counter,
        )

    whole = server_count(policy, build(None))
    assert build(whole) == build(None)  # the counter's total is the server's
    fewer = build(whole - 1)  # one token short: the oldest screenshot goes
    assert len(fewer) == len(build(None)) - 1
    least = server_count(policy, build(1))  # system, instruction and current screen
    for budget in range(whole - 1, least - 1, -max(23, (whole - least) // 12)):
        assert server_count(policy, build(budget)) <= budget
    texts = sum(len(t.text) for t in TURNS)
    exact = sum(counter.tokens(t.text) for t in TURNS)
    assert abs(math.ceil(texts / 4) - exact) > exact // 3  # what characters / 4 made of it


def test_the_byte_bound_never_counts_less(shipped) -> None:
    policy, counter = shipped
    bound = counter.as_bound()
    for turn in TURNS:
        assert bound.text(role="assistant", text=turn.text) >= counter.text(
            role="assistant", text=turn.text
        )
    screens = [png(500, 320) for _ in range(len(TURNS) + 1)]

    def build(budget: int, counter: PromptCounter) -> list[dict]:
        return build_messages(
            instruction="Click 1234.",
            history=TURNS,
            screenshots=screens,
            max_prompt_tokens=budget,
            counter=counter,
        )

    least = server_count(policy, build(1, counter))
    for budget in (least + 50, least + 200, least + 600):
        assert server_count(policy, build(budget, bound)) <= budget


def test_a_checkpoint_without_a_tokenizer_is_refused(tmp_path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(
        (SHIPPED / "preprocessor_config.json").read_text()
    )
    with pytest.raises(ValueError, match=r"tokenizer\.json: missing"):
        PromptCounter.from_policy_dir(tmp_path)
