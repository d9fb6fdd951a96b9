"""A prompt's length in tokens as the policy's processor counts it, before it is sent.

    counter = PromptCounter.from_policy_dir("policies/tiny-grounded")
    counter.text(role="assistant", text="Thought: ...")  # tokens of the message, framing included
    counter.image(png)                                    # tokens of a user message holding it

A prompt is what the inference server tokenizes: the chat template rendered over its messages,
tokenized without extra special tokens, each image's one `<|image_pad|>` expanded to the
image's tokens (`core.encoding.prompt_token_count`). The counter renders each kind of message
through the checkpoint's own chat template once, with a placeholder for the content, and keeps
what the template writes around it; a message then costs the tokens of that text with its
content in place. Messages are separated by the template's special tokens (`<|im_start|>`,
`<|im_end|>`), which a tokenizer never merges across, so a prompt's count is the sum of its
messages' and the generation prompt's: the servers' own count, to the token
(`tests/core/test_prompt_counter.py`, `tests/rollout/test_prompt_budget.py`).

What it reads of a checkpoint is small (`COUNTER_FILES`): an env worker fetches those, not the
weights (`datamanager.policies.policy_prompt_counter`). Without a tokenizer (the scripted
oracle, which no server counts; the episode's second try at a prompt a server refused),
`PromptCounter.bound` and `as_bound` count UTF-8 bytes instead: no byte-level BPE (Qwen's)
writes more tokens than bytes, so a budget the bound meets, the tokenizer meets; it only keeps
less history.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image
from tokenizers import Tokenizer

from core.imaging import GEOMETRY_FILE, ImageGeometry

QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The chat template Qwen2-VL and UI-TARS ship, for checkpoints that carry none."""

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
COUNTER_FILES = frozenset({GEOMETRY_FILE, TOKENIZER_FILE, *TEMPLATE_FILES})
"""The files of a checkpoint a prompt counter reads (those it has of them)."""

ROLES = ("system", "user", "assistant")
_CONTENT = "DARTBOARDCONTENTPLACEHOLDER"  # letters only: no template escapes or trims them


def chat_template_of(path: str | Path) -> str:
    """The chat template of the checkpoint at `path`: chat_template.jinja, else
    chat_template.json, else tokenizer_config.json's, else Qwen2-VL's."""
    path = Path(path)
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text())["chat_template"]
    if (path / "tokenizer_config.json").is_file():
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return QWEN2_VL_CHAT_TEMPLATE


@dataclass(frozen=True)
class Framing:
    """What a chat template writes around a message's content, read off the template itself.

    text: role -> (before, after) the content of a message holding text;
    image: a user message holding one image, its image as one `<|image_pad|>`;
    reply: the generation prompt that ends every prompt."""

    text: dict[str, tuple[str, str]]
    image: str
    reply: str

    @classmethod
    def of(cls, template: str) -> Framing:
        """Rendered as transformers' `apply_chat_template` renders it (its own renderer);
        ValueError for a template that does not write a message's content as it is."""
        # Deferred: transformers' import costs about a second, paid where a counter is built.
        from transformers.utils.chat_template_utils import render_jinja_template

        def render(messages: list[dict[str, Any]], *, reply: bool = False) -> str:
            return render_jinja_template(
                conversations=[messages], chat_template=template, add_generation_prompt=reply
            )[0][0]

        system = {"role": "system", "content": "x"}  # first, so no default system is added
        opening = render([system])

        def alone(message: dict[str, Any]) -> str:
            rendered = render([system, message])
            if not rendered.startswith(opening):
                raise ValueError("the chat template renders a message differently after another")
            return rendered[len(opening) :]

        text = {}
        for role in ROLES:
            rendered = render([{"role": role, "content": _CONTENT}])
            if role != "system":
                rendered = alone({"role": role, "content": _CONTENT})
            before, found, after = rendered.partition(_CONTENT)
            if not found or _CONTENT in after:
                raise ValueError(f"the chat template does not write a {role} message's text as is")
            text[role] = (before, after)
        image = alone({"role": "user", "content": [{"type": "image"}]})
        reply = render([system], reply=True)[len(opening) :]
        return cls(text=text, image=image, reply=reply)


@dataclass(frozen=True)
class PromptCounter:
    """Tokens a prompt's messages take for the policy whose processor has `geometry`,
    tokenizer `tokenizer` (a `tokenizers.Tokenizer`; None: UTF-8 bytes, an upper bound) and
    chat template `framing`. Built once per episode's policy; thread-safe."""

    geometry: ImageGeometry
    framing: Framing
    tokenizer: Any = None

    @classmethod
    def from_policy_dir(cls, path: str | Path) -> PromptCounter:
        """The counter of the checkpoint at `path` (its `COUNTER_FILES`; ValueError without a
        tokenizer.json)."""
        path = Path(path)
        if not (path / TOKENIZER_FILE).is_file():
            raise ValueError(f"{path / TOKENIZER_FILE}: missing; a policy needs its tokenizer")
        return cls(
            geometry=ImageGeometry.from_policy_dir(path),
            framing=Framing.of(chat_template_of(path)),
            tokenizer=Tokenizer.from_file(str(path / TOKENIZER_FILE)),
        )

    @classmethod
    def bound(
        cls, geometry: ImageGeometry, template: str = QWEN2_VL_CHAT_TEMPLATE
    ) -> PromptCounter:
        """A counter without a tokenizer: text at one token per UTF-8 byte, never fewer than
        a byte-level BPE writes (module docstring)."""
        return cls(geometry=geometry, framing=Framing.of(template))

    def as_bound(self) -> PromptCounter:
        """This counter with its text counted at the upper bound (UTF-8 bytes)."""
        return replace(self, tokenizer=None)

    def tokens(self, text: str) -> int:
        """Tokens of `text` (special tokens written in it count as one each)."""
        if self.tokenizer is None:
            return len(text.encode("utf-8"))
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, *, role: str, text: str) -> int:
        """Tokens of a `role` message holding `text`, with the template's framing."""
        before, after = self.framing.text[role]
        return self.tokens(before + text + after)

    def image(self, png: bytes) -> int:
        """Tokens of a user message holding the screenshot `png` (its header is read)."""
        with Image.open(io.BytesIO(png)) as image:
            width, height = image.size
        # The template writes one <|image_pad|>; the processor expands it to the image's tokens.
        return (
            self.tokens(self.framing.image) - 1 + self.geometry.tokens(width=width, height=height)
        )

    @property
    def reply(self) -> int:
        """Tokens of the generation prompt that ends the prompt."""
        return self.tokens(self.framing.reply)
