r"""The prompt builder shared by the rollout service and the trainer.

`build_messages` produces OpenAI chat-completions messages in the UI-TARS layout::

    system     the template's system prompt
    user       the template's head: the instruction (and, for UI-TARS-1.5, the whole
               computer-use prompt around it)
    user       [image] screenshot before turn i      (only for the last `max_images` screens)
    assistant  "Thought: ...\nAction: ..."  of turn i  (every kept turn)
    ...
    user       [image] the current screen            (always)

Screenshots beyond the last `max_images` are left out but their turns keep their text, as
UI-TARS does ("all texts and the most recent 5 images"). Under a token budget, counted as the
policy's processor counts it (`core.prompt_counter`), the oldest screenshots go first, their
turns keeping their text; then the oldest turns' texts. The system prompt, the instruction and
the current screenshot are never dropped.

`core.encoding.to_qwen_messages` turns these messages into the Qwen2-VL chat-template form
used by the inference server and the trainer; `decode_image_parts` returns the images' bytes.

Run the tests with ``.venv/bin/pytest -p no:django tests/core/test_prompts.py -q``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.actions import split_output
from core.prompt_counter import PromptCounter

DEFAULT_SYSTEM_PROMPT = r"""You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
Thought: ...
Action: ...

## Action Space
click(start_box='<|box_start|>(x1,y1)<|box_end|>')
left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')
right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')
drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')
hotkey(key='ctrl c') # Split keys with a space and use lowercase. At most 3 keys.
type(content='xxx') # Escape \', \" and \n in content. End content with \n to submit.
scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left')
wait() # Sleep for 5s and take a screenshot to check for any changes.
finished(content='xxx') # The task is done; content is the answer, if one is asked for.
call_user() # The task is unsolvable, or you need the user's help.

## Note
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part."""

UI_TARS_15_HEAD = r"""You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task. 

## Output Format
```
Thought: ...
Action: ...
```

## Action Space
click(start_box='<|box_start|>(x1,y1)<|box_end|>')
left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')
right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')
drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')
hotkey(key='')
type(content='') #If you want to submit your input, use "\\n" at the end of `content`.
scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left')
wait() #Sleep for 5s and take a screenshot to check for any changes.
finished()
call_user() # Submit the task and call the user when the task is unsolvable, or when you need the user's help.

## Note
- Use {language} in `Thought` part.
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part.

## User Instruction
{instruction}
"""  # noqa: W291 - the released template's line ends with a space


@dataclass(frozen=True)
class PromptTemplate:
    """Where the computer-use prompt goes. `head` is the first user message, formatted with
    `instruction` and `language`. `thoughts`: its replies begin with a Thought line."""

    name: str
    system: str
    head: str
    thoughts: bool = False

    def first_user_message(self, *, instruction: str, language: str) -> str:
        # Not str.format: an instruction holding braces must come through as it is.
        return self.head.replace("{language}", language).replace("{instruction}", instruction)


PROMPT_TEMPLATES: dict[str, PromptTemplate] = {
    # Dartboard's own: the action list in the system prompt, the instruction alone after it
    # (what the shipped tiny policy was pretrained on).
    "dartboard": PromptTemplate("dartboard", DEFAULT_SYSTEM_PROMPT, "{instruction}"),
    # UI-TARS-1.5's computer-use template as its released agents send it (OSWorld's UI-TARS-1.5
    # agent): a bare system prompt, then one user message with the output format, the action
    # list, the language line and the instruction at the end. Coordinates are absolute pixels
    # of the processor-resized screenshot (run setting rollout.coords = "pixel").
    "ui-tars-1.5": PromptTemplate(
        "ui-tars-1.5", "You are a helpful assistant.", UI_TARS_15_HEAD, thoughts=True
    ),
}
PROMPT_NAMES: tuple[str, ...] = tuple(PROMPT_TEMPLATES)

Message = dict[str, Any]


STRUCTURE_TOKENS = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
)


@dataclass(frozen=True)
class HistoryTurn:
    """One earlier assistant turn: its thought and its action call text.

    Screenshots are passed to `build_messages` separately, aligned from the end (the last
    screenshot is the current screen, the one before it belongs to the last turn, ...).
    """

    thought: str
    action_text: str

    @classmethod
    def from_output(cls, text: str) -> HistoryTurn:
        """A turn from the model's raw text, even malformed (no Action line: thought only).

        Chat-structure tokens are removed: replayed as history they would become image slots
        or turn boundaries (a server that does not suppress them can emit them)."""
        for token in STRUCTURE_TOKENS:
            text = text.replace(token, "")
        thought, action_text = split_output(text)
        return cls(thought=thought, action_text=action_text or "")

    @property
    def text(self) -> str:
        """The assistant message: ``Thought: ...\\nAction: ...`` (empty parts left out)."""
        parts = []
        if self.thought:
            parts.append(f"Thought: {self.thought}")
        if self.action_text:
            parts.append(f"Action: {self.action_text}")
        return "\n".join(parts)


def image_part(png: bytes) -> dict[str, Any]:
    """An OpenAI content part holding a PNG as a base64 data URL."""
    url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


def build_messages(
    *,
    instruction: str,
    history: Sequence[HistoryTurn],
    screenshots: Sequence[bytes],
    max_images: int = 5,
    template: PromptTemplate = PROMPT_TEMPLATES["dartboard"],
    language: str = "English",
    max_prompt_tokens: int | None = None,
    counter: PromptCounter | None = None,
    step_refs: Sequence[int] | None = None,
) -> list[Message]:
    """The chat messages for the next turn (layout in the module docstring).

    `step_refs` (one per screenshot: the step whose screen it is): the images are written as
    references to those steps (`step_image_part`) instead of inline, the prompt as a step
    stores it; `prompt_messages` puts the screenshots back in.

    `screenshots` are PNGs, oldest first, aligned from the end: the last is the current
    screen and the one before belongs to ``history[-1]``. Between 1 and len(history) + 1 may
    be given (the caller only needs to load the last `max_images`).

    Budget: with `max_prompt_tokens`, `counter` (the policy's `PromptCounter`; required with a
    budget) counts each message as the server will, framing and generation prompt included.
    While the prompt passes the budget, the oldest screenshot of an earlier turn goes (its
    turn keeps its text), and once none is left, the oldest turn's text. If even system +
    instruction + current screen do not fit, those are returned anyway (the server then
    rejects the request with its own message).

    Long because the layout, the image window and the token budget decide together which
    turns stay; split apart, each would need the others' intermediate lists.
    """
    if not screenshots:
        raise ValueError("build_messages needs at least one screenshot (the current screen)")
    if len(screenshots) > len(history) + 1:
        raise ValueError(
            f"got {len(screenshots)} screenshots for {len(history)} history turns; at most "
            f"{len(history) + 1} (one per earlier turn, then the current screen)"
        )
    if max_images < 1:
        raise ValueError(f"max_images must be at least 1 (the current screen), got {max_images}")
    if step_refs is not None and len(step_refs) != len(screenshots):
        raise ValueError(f"{len(step_refs)} step_refs for {len(screenshots)} screenshots")

    n_turns = len(history)
    offset = n_turns + 1 - len(screenshots)  # turns before this one have no screenshot given
    first_image = max(offset, n_turns + 1 - max_images)  # the oldest turn shown with its screen
    first_text = 0  # the oldest turn shown at all
    head = template.first_user_message(instruction=instruction, language=language)
    if max_prompt_tokens is not None:
        if counter is None:
            raise ValueError("a prompt token budget needs the policy's PromptCounter")
        texts = [counter.text(role="assistant", text=turn.text) for turn in history]
        images = [counter.image(png) for png in screenshots[first_image - offset : -1]]
        total = (
            counter.text(role="system", text=template.system)
            + counter.text(role="user", text=head)
            + counter.image(screenshots[-1])
            + counter.reply
            + sum(texts)
            + sum(images)
        )
        while total > max_prompt_tokens and first_text < n_turns:
            if first_image < n_turns:
                total -= images.pop(0)
                first_image += 1
            else:
                total -= texts[first_text]
                first_text += 1

    def part(i: int) -> dict[str, Any]:
        """Turn i's image part (i == n_turns: the current screen)."""
        k = i - offset
        return (
            step_image_part(step_refs[k]) if step_refs is not None else image_part(screenshots[k])
        )

    messages: list[Message] = [
        {"role": "system", "content": template.system},
        {"role": "user", "content": head},
    ]
    for i in range(first_text, n_turns):
        if i >= first_image:
            messages.append({"role": "user", "content": [part(i)]})
        messages.append({"role": "assistant", "content": history[i].text})
    messages.append({"role": "user", "content": [part(n_turns)]})
    return messages


STEP_IMAGE = "step_image"


def step_image_part(step: int) -> dict[str, Any]:
    """A stored prompt's image: the screenshot of the trajectory's step `step`."""
    return {"type": STEP_IMAGE, "step": step}


def _is_step_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == STEP_IMAGE


def prompt_steps_shown(prompt: Sequence[Message]) -> list[int]:
    """The steps whose screenshots a stored prompt shows, in order."""
    return [
        part["step"]
        for message in prompt
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if _is_step_image(part)
    ]


def prompt_messages(prompt: Sequence[Message], screenshots: Sequence[bytes]) -> list[Message]:
    """A stored prompt (`build_messages` with `step_refs`) as the messages the policy was
    given: each step reference replaced by that step's screenshot (`screenshots[step]`)."""
    out: list[Message] = []
    for message in prompt:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                image_part(screenshots[part["step"]]) if _is_step_image(part) else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def _image_url(part: dict[str, Any]) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ValueError("an image_url part needs image_url.url")
    return url


def _decode_data_url(url: str) -> bytes:
    head, sep, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and sep):
        raise ValueError(f"image_url must be a base64 data:image/... URL, got {url[:40]!r}")
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as error:
        raise ValueError(f"image_url data is not valid base64: {error}") from error


def _content_parts(message: Message) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return content
    raise ValueError(
        f"a {message.get('role')!r} message needs content as a string or a list of parts"
    )


def decode_image_parts(messages: Sequence[Message]) -> list[bytes]:
    """The bytes of every image_url part (base64 data URLs), in message order."""
    return [
        _decode_data_url(_image_url(part))
        for message in messages
        for part in _content_parts(message)
        if part.get("type") == "image_url"
    ]
