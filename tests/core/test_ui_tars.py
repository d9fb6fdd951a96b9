"""A UI-TARS-1.5 checkpoint's view of the world: its own computer-use prompt, and its answers
on a known screenshot landing on the right screen pixel at three screen sizes, in both
coordinate conventions, with the model's image size taken from the real image processor."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from core.actions import parse_output, to_screen
from core.imaging import QWEN25_VL
from core.prompts import PROMPT_TEMPLATES, HistoryTurn, build_messages, decode_image_parts
from tests.conftest import png_bytes

RED = (220, 30, 30)


def screenshot(width: int, height: int) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """A white screen with one red 48x28 button away from the centre; its box (x0, y0, x1, y1)."""
    image = Image.new("RGB", (width, height), (255, 255, 255))
    x0, y0 = int(width * 0.63), int(height * 0.41)
    box = (x0, y0, x0 + 48, y0 + 28)
    image.paste(RED, box)
    return image, box


def red_centre(image: Image.Image) -> tuple[float, float]:
    pixels = np.asarray(image).astype(int)
    red = (pixels[..., 0] > 150) & (pixels[..., 1] < 110) & (pixels[..., 2] < 110)
    ys, xs = np.nonzero(red)
    return float(xs.mean()), float(ys.mean())


def processor_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of the image UI-TARS-1.5's processor feeds the model."""
    processor = QWEN25_VL.processor()
    _, grid_h, grid_w = processor(images=[image], return_tensors="np")["image_grid_thw"][0]
    return int(grid_w) * 14, int(grid_h) * 14


@pytest.mark.parametrize("size", [(800, 600), (1280, 720), (1920, 1080)])
@pytest.mark.parametrize("coords", ["pixel", "relative1000"])
def test_an_answer_on_a_known_screenshot_lands_on_the_button(size, coords) -> None:
    width, height = size
    image, (x0, y0, x1, y1) = screenshot(width, height)
    model_size = QWEN25_VL.model_size(width=width, height=height)
    assert model_size == processor_size(image)  # one source: the processor's own resize
    seen = image.resize(model_size, Image.Resampling.BICUBIC)  # what the model looks at
    mx, my = red_centre(seen)
    if coords == "pixel":  # UI-TARS-1.5 / Qwen2.5-VL: pixels of the resized image
        x, y = round(mx), round(my)
    else:  # UI-TARS-1.0 / Qwen2-VL: thousandths of the image
        x, y = round(1000 * mx / model_size[0]), round(1000 * my / model_size[1])
    answer = (
        "Thought: The submit button is the red one to the right.\n"
        f"Action: click(start_box='<|box_start|>({x},{y})<|box_end|>')"
    )
    action = parse_output(answer, coords=coords).action
    on_screen = to_screen(action, screen_size=size, model_size=model_size, coords=coords)
    assert x0 <= on_screen.x < x1 and y0 <= on_screen.y < y1, (on_screen, (x0, y0, x1, y1))


def test_the_ui_tars_template_is_its_computer_use_prompt() -> None:
    screens = [png_bytes(64, 48, (i, i, i)) for i in range(3)]
    history = [
        HistoryTurn("Open the menu.", "click(start_box='(10,20)')"),
        HistoryTurn("Type the name.", "type(content='report.txt')"),
    ]
    messages = build_messages(
        instruction="Save the file as {name}.txt",  # braces come through untouched
        history=history,
        screenshots=screens,
        template=PROMPT_TEMPLATES["ui-tars-1.5"],
        language="Chinese",
    )
    assert messages[0] == {"role": "system", "content": "You are a helpful assistant."}
    head = messages[1]
    assert head["role"] == "user"
    assert head["content"].startswith("You are a GUI agent. You are given a task")
    assert "## Output Format\n```\nThought: ...\nAction: ...\n```" in head["content"]
    assert "- Use Chinese in `Thought` part." in head["content"]
    assert head["content"].endswith("## User Instruction\nSave the file as {name}.txt\n")
    assert [m["role"] for m in messages[2:]] == ["user", "assistant", "user", "assistant", "user"]
    assert messages[3]["content"] == "Thought: Open the menu.\nAction: click(start_box='(10,20)')"
    assert decode_image_parts(messages) == screens


def test_dartboards_template_is_unchanged_for_the_shipped_policy() -> None:
    png = io.BytesIO()
    Image.new("RGB", (32, 32)).save(png, format="PNG")
    messages = build_messages(instruction="Click OK", history=[], screenshots=[png.getvalue()])
    assert messages[0]["content"] == PROMPT_TEMPLATES["dartboard"].system
    assert messages[0]["content"].startswith("You are a GUI agent.")
    assert messages[1] == {"role": "user", "content": "Click OK"}


def test_the_ui_tars_prompt_refuses_the_tiny_policys_token_budgets() -> None:
    """A Thought and an Action run to hundreds of tokens, and one 1920x1080 screenshot is
    2,691 prompt tokens: the tiny policy's 64 and 4096 would cut every turn short."""
    from datamanager.config import ConfigError, RunConfig

    with pytest.raises(ConfigError) as short:
        RunConfig.from_dict({"rollout": {"prompt": "ui-tars-1.5"}})
    assert short.value.path == "rollout.max_new_tokens" and "at least 256 (got 64)" in str(
        short.value
    )
    with pytest.raises(ConfigError) as small:
        RunConfig.from_dict({"rollout": {"prompt": "ui-tars-1.5", "max_new_tokens": 512}})
    assert small.value.path == "rollout.max_prompt_tokens" and "2,691 tokens" in str(small.value)
    RunConfig.from_dict(
        {"rollout": {"prompt": "ui-tars-1.5", "max_new_tokens": 512, "max_prompt_tokens": 16384}}
    )
