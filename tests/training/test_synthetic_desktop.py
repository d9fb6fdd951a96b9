"""The desktop pretraining's synthetic episodes: each step's target is where the screen shows
the thing the instruction names, the response taught for it lands inside that target once
it goes through the policy's processor geometry and back, and every step's prompt carries
the episode's earlier actions as the rollout sends them."""

from __future__ import annotations

import functools
import io
import random

import pytest
from PIL import Image

from core.actions import format_screen_action, parse_output
from core.protocol import Action, ActionType
from training.pretrain_io import (
    action_correct,
    predicted_action,
    sample_messages,
    sample_response,
    target_image_tokens,
)
from training.synthetic_desktop import AREA_COLORS, HEIGHT, SCENES, WIDTH, make_episode
from training.tiny_policy import TINY_GEOMETRY


@functools.cache
def _episodes() -> list:
    """60 episodes, drawn once in the worker that runs this module (not at every worker's
    collection: drawing them encodes a PNG per step)."""
    return [make_episode(random.Random(seed)) for seed in range(60)]


def _pixel(step, xy):
    return Image.open(io.BytesIO(step.png)).convert("RGB").getpixel(xy)


def _named(instruction: str) -> list[str]:
    return [c for c in AREA_COLORS if f" {c} " in instruction]


def test_every_scene_is_drawn_at_the_desktop_size_with_its_targets_on_the_screen():
    scenes = {ep[0].source for ep in _episodes()}
    assert scenes >= {f"desktop/{s}" for s in SCENES if s != "pad"} | {"desktop/pad-left_double"}
    for episode in _episodes():
        assert episode[-1].action.type == ActionType.FINISHED  # every episode ends by saying so
        for step in episode:
            assert (step.width, step.height) == (WIDTH, HEIGHT)
            assert Image.open(io.BytesIO(step.png)).size == (WIDTH, HEIGHT)
            points = [(step.action.x, step.action.y), (step.action.x2, step.action.y2)]
            for (x, y), box in zip(points, step.boxes, strict=False):
                assert 0 <= box[0] <= x < box[2] <= WIDTH and 0 <= box[1] <= y < box[3] <= HEIGHT


def test_the_target_shows_what_the_instruction_names():
    checked = 0
    for episode in _episodes():
        first = episode[0]
        x, y = first.action.x, first.action.y
        if first.source.startswith("desktop/pad-"):
            (colour,) = _named(first.instruction)
            # the label may cover the centre: the area's corner has its colour
            box = first.boxes[0]
            assert box[0] <= x < box[2] and box[1] <= y < box[3]
            assert _pixel(first, (box[0] + 2, box[1] + 2)) in AREA_COLORS[colour]
            checked += 1
        elif first.source == "desktop/drag":
            square, target = first.boxes
            colour = first.instruction.split(" the ")[1].split(" square")[0]
            assert _pixel(first, (square[0] + 3, square[1] + 3)) in AREA_COLORS[colour]
            outline = first.instruction.split("into the ")[1].split(" ")[0]
            assert _pixel(first, (target[0] + 1, (target[1] + target[3]) // 2)) in [
                c[:3] for c in AREA_COLORS[outline]
            ]
            # after the drag, the square sits inside the box
            after = episode[1]
            assert _pixel(after, (first.action.x2, first.action.y2)) in AREA_COLORS[colour]
            checked += 1
        elif first.source == "desktop/web-button":
            box = first.boxes[0]
            assert _pixel(first, (box[0] + 3, box[1] + 3)) == (239, 239, 239)  # a button's face
            checked += 1
    assert checked >= 20


def test_typing_episodes_type_the_quoted_text_and_save():
    seen = set()
    for episode in _episodes():
        kinds = [s.action.type for s in episode]
        if episode[0].source == "desktop/editor-type":
            quoted = episode[0].instruction.split("'")[1]
            assert kinds == [
                ActionType.CLICK,
                ActionType.TYPE,
                ActionType.HOTKEY,
                ActionType.FINISHED,
            ]
            assert episode[1].action.text == quoted and episode[2].action.key == "ctrl s"
            assert episode[2].png != episode[1].png  # the typed text shows before saving
        elif episode[0].source == "desktop/terminal":
            command = episode[1].action.text
            assert command.startswith("echo ") and command.endswith("\n")
            assert command.split()[1] in episode[0].instruction
        elif episode[0].source == "desktop/editor-clear":
            assert [s.action.key for s in episode[1:4]] == ["ctrl a", "delete", "ctrl s"]
        seen.add(episode[0].source)
    assert {"desktop/editor-type", "desktop/terminal", "desktop/editor-clear"} <= seen


def test_the_taught_response_lands_on_the_target_through_the_processor_geometry():
    model_size = TINY_GEOMETRY.model_size(width=WIDTH, height=HEIGHT)
    assert model_size != (WIDTH, HEIGHT)  # the model sees a resized screen: coordinates map
    for episode in _episodes()[:30]:
        for step in episode:
            text = sample_response(step, coords="pixel", geometry=TINY_GEOMETRY)
            model_action = parse_output(text, coords="pixel").action
            if model_action.x is not None:
                assert 0 <= model_action.x < model_size[0] and 0 <= model_action.y < model_size[1]
            back = predicted_action(text, sample=step, coords="pixel", geometry=TINY_GEOMETRY)
            assert action_correct(back, step), (step.source, text)
            tokens = target_image_tokens(step, geometry=TINY_GEOMETRY)
            assert bool(tokens) == bool(step.boxes)


def test_a_wrong_action_is_not_counted_correct():
    step = next(s for s in make_episode(random.Random(5), scene="pad") if s.boxes)
    right = format_screen_action(step.action, screen_size=(WIDTH, HEIGHT), geometry=TINY_GEOMETRY)
    outside = Action(type=step.action.type, x=0, y=0)  # the desktop's corner: never the target
    other = Action(type=ActionType.CLICK if step.action.type != ActionType.CLICK else ActionType.RIGHT_SINGLE,
                   x=step.action.x, y=step.action.y)  # fmt: skip
    wrong = [
        format_screen_action(a, screen_size=(WIDTH, HEIGHT), geometry=TINY_GEOMETRY)
        for a in (outside, other, Action(type=ActionType.FINISHED, text="done"))
    ] + ["nonsense"]
    assert action_correct(
        predicted_action(right, sample=step, coords="pixel", geometry=TINY_GEOMETRY), step
    )
    for text in wrong:
        got = predicted_action(text, sample=step, coords="pixel", geometry=TINY_GEOMETRY)
        assert not action_correct(got, step), text


def test_each_step_prompt_holds_the_earlier_actions_and_only_the_current_screen():
    (episode,) = [ep for ep in _episodes() if ep[0].source == "desktop/editor-clear"][:1]
    for i, step in enumerate(episode):
        messages = sample_messages(step, geometry=TINY_GEOMETRY)
        turns = [m for m in messages if m["role"] == "assistant"]
        images = [p for m in messages if isinstance(m["content"], list) for p in m["content"]
                  if p.get("type") == "image_url"]  # fmt: skip
        assert len(turns) == i and len(images) == 1
        for turn, action in zip(turns, step.history, strict=True):
            text = (
                turn["content"] if isinstance(turn["content"], str) else turn["content"][0]["text"]
            )
            assert parse_output(text, coords="pixel").action.type == action.type
    with pytest.raises(ValueError, match="needs the policy's geometry"):
        sample_messages(episode[1])
