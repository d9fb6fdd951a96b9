"""Prompt and response encoding, shared by the rollout workers and the trainer so both
tokenize alike.

Messages use the OpenAI chat-completions format (content a string or a list of
`{"type": "text", "text": ...}` / `{"type": "image_url", "image_url": {"url": "data:..."}}`).
`to_qwen_messages` turns them into the Qwen2-VL chat-template form plus the ordered images.

A prompt is `chat_template(messages, add_generation_prompt=True)` tokenized without extra
special tokens, each `<|image_pad|>` expanded to the image's token count. A response is
the sampled tokens, ending with `<|im_end|>` when the model stopped. `core.generation`'s
`generate` (rollout) and `encode_prompt_response` with `sequence_logprobs` (training) share
these functions.

Images: the image processor resizes and cuts each screenshot into patches on the CPU; the
patches stay uint8 until they are where the model is, where `PixelNorm` rescales and
normalizes them with the processor's own arithmetic. The values equal the processor's
`pixel_values` bit for bit, a quarter of the bytes cross to the GPU, and the float work runs
there instead of on the CPU in front of it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from core.policy import Policy

Message = dict[str, Any]


@dataclass(frozen=True)
class PixelNorm:
    """The image processor's rescale and normalize, done where the patches are: uint8 to
    float64 times `scale`, to float32, then (x - mean) / std per channel in float32, as
    transformers' numpy rescale and normalize compute them (equal bit for bit). None in a
    field: the processor skips that step."""

    scale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    channels: int = 3

    @classmethod
    def of(cls, processor: Any) -> PixelNorm:
        normalize = bool(processor.do_normalize)
        return cls(
            scale=float(processor.rescale_factor) if processor.do_rescale else None,
            mean=tuple(float(v) for v in processor.image_mean) if normalize else None,
            std=tuple(float(v) for v in processor.image_std) if normalize else None,
        )

    def apply(self, patches: torch.Tensor) -> torch.Tensor:
        """Float32 pixel values of uint8 patches [P, C*T*p*p] (channel-major, as patchify
        lays them out), on the patches' device."""
        x = patches.to(torch.float64)
        if self.scale is not None:
            x = x * self.scale
        x = x.to(torch.float32)
        if self.mean is None or self.std is None:
            return x
        rows = x.view(x.shape[0], self.channels, -1)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=x.device)[:, None]
        std = torch.tensor(self.std, dtype=torch.float32, device=x.device)[:, None]
        return ((rows - mean) / std).view(x.shape[0], -1)


@dataclass
class EncodedBatch:
    """Left-padded model inputs for B conversations (N images in total).

    input_ids, attention_mask, mm_token_type_ids: [B, T] (mm type 1 = image token);
    patches: [P, C*2*14*14] uint8 flattened patches of all images or None, made pixel values
    by `pixel_norm` where the model is (`pixel_values()`); image_grid_thw: [N, 3] or None;
    response_mask: [B, T] bool, True on response tokens (all False for prompts only).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor
    patches: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    response_mask: torch.Tensor
    pixel_norm: PixelNorm | None = None
    # [N] each image's content key (its data URL's digest), where the prompts were encoded
    # with them (`PromptParts.image_keys`): the same screenshot has the same key.
    image_keys: tuple[bytes, ...] = ()

    def pixel_values(self) -> torch.Tensor | None:
        """The model's float32 pixel values, computed on the patches' device."""
        if self.patches is None or self.pixel_norm is None:
            return None
        return self.pixel_norm.apply(self.patches)

    def model_inputs(self, *, pixels: bool = True) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward / generate. `pixels` False: without
        the pixel values (the caller hands the model the vision tower's output instead)."""
        out: dict[str, torch.Tensor] = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "mm_token_type_ids": self.mm_token_type_ids,
        }
        if self.image_grid_thw is None:
            return out
        out["image_grid_thw"] = self.image_grid_thw
        values = self.pixel_values() if pixels else None
        if values is not None:
            out["pixel_values"] = values
        return out

    def to(self, device: torch.device | str) -> EncodedBatch:
        """The batch on `device`; the uint8 patches cross from pinned memory when CUDA is the
        destination, without blocking the host."""

        def move(t: torch.Tensor | None) -> Any:
            if t is None:
                return None
            if t.device.type == "cpu" and torch.device(device).type == "cuda":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        return EncodedBatch(
            input_ids=move(self.input_ids),
            attention_mask=move(self.attention_mask),
            mm_token_type_ids=move(self.mm_token_type_ids),
            patches=move(self.patches),
            image_grid_thw=move(self.image_grid_thw),
            response_mask=move(self.response_mask),
            pixel_norm=self.pixel_norm,
            image_keys=self.image_keys,
        )


def to_qwen_messages(messages: list[Message]) -> tuple[list[Message], list[Image.Image]]:
    """OpenAI chat messages -> (Qwen2-VL chat-template messages, images in prompt order).

    Images must be inline data URLs (`data:image/png;base64,...`): workers never fetch URLs.
    Raises ValueError naming the offending field.
    """
    out, urls = _qwen_layout(messages)
    return out, [_decode_data_url(url, where=where) for url, where in urls]


def _qwen_layout(messages: list[Message]) -> tuple[list[Message], list[tuple[Any, str]]]:
    """The chat-template messages and each image's (URL, field), in prompt order, the images
    not decoded yet; ValueError naming the offending field."""
    out: list[Message] = []
    urls: list[tuple[Any, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "user",
            "assistant",
        ):
            raise ValueError(f"messages[{i}].role must be 'system', 'user' or 'assistant'")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        parts: list[dict[str, str]] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                urls.append(((part.get("image_url") or {}).get("url"), f"{where}.image_url.url"))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"{where} must be a text part or an image_url part")
        out.append({"role": message["role"], "content": parts})
    return out, urls


MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest image a request may carry (a 4K screen fits); checked on the header, before the
pixels are decoded, so a small PNG declaring a huge canvas costs nothing."""


def _open_data_url(url: Any, *, where: str) -> Image.Image:
    """The image of a data URL with its header read and its pixels not decoded yet."""
    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise ValueError(f"{where} must be a data:image/...;base64, URL")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1])))
    except Exception as exc:
        raise ValueError(f"{where} is not a decodable image: {exc}") from exc
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"{where} is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels per image"
        )
    return image


def _decode_data_url(url: Any, *, where: str) -> Image.Image:
    image = _open_data_url(url, where=where)
    try:
        return image.convert("RGB")
    except Exception as exc:
        raise ValueError(f"{where} is not a decodable image: {exc}") from exc


def prompt_token_count(
    policy: Policy, qwen_messages: list[Message], images: list[Image.Image]
) -> int:
    """Tokens the prompt will take, images included, without running the image processor
    (the geometry gives each image's token count)."""
    ids = _template_ids(policy, qwen_messages)
    geometry = policy.image_geometry
    image_tokens = sum(geometry.tokens(width=im.width, height=im.height) for im in images)
    return len(ids) - len(images) + image_tokens


def prompt_length(policy: Policy, messages: list[Message], *, ids: list[int] | None = None) -> int:
    """Tokens the prompt takes in a batch, image pads expanded, as `prompt_parts` encodes it
    (`ids` as it takes them), without decoding a pixel: each image's tokens come from the
    size in its header and the processor's geometry. What a micro-batch's token budget counts
    (`training.micro_batches`)."""
    qwen_messages, urls = _qwen_layout(messages)
    template_ids = list(ids) if ids else _template_ids(policy, qwen_messages)
    pads = template_ids.count(policy.token_id("<|image_pad|>"))
    if not urls or pads != len(urls):  # no images, or the server's ids have them expanded
        return len(template_ids)
    geometry = policy.image_geometry
    sizes = [_open_data_url(url, where=where).size for url, where in urls]
    return len(template_ids) - pads + sum(geometry.tokens(width=w, height=h) for w, h in sizes)


def _template_ids(policy: Policy, qwen_messages: list[Message]) -> list[int]:
    """The chat template's token ids, one `<|image_pad|>` per image."""
    text = policy.tokenizer.apply_chat_template(
        qwen_messages,
        chat_template=policy.chat_template,
        tokenize=False,
        add_generation_prompt=True,
    )
    return policy.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class PromptParts:
    """One prompt, encoded: token ids with image pads expanded, and its images' patches.
    What `encode_batch` pads into a batch; the trainer keeps these to encode a step once per
    update (`training.trainer`)."""

    ids: list[int]
    patches: torch.Tensor | None  # [P, C*2*14*14] uint8 or None
    image_grid_thw: torch.Tensor | None  # [N, 3] or None
    image_keys: tuple[bytes, ...] = ()  # [N] each image's data URL digest (its content)

    @property
    def nbytes(self) -> int:
        patches = self.patches
        return 8 * len(self.ids) + (
            0 if patches is None else patches.numel() * patches.element_size()
        )


class ImageCache:
    """The last `max_entries` screenshots encoded: each one's patches [P, C*2*14*14] uint8
    and grid [1, 3], keyed by its data URL's digest. A step shows the last few screenshots of
    its trajectory, so the steps of an update show each one up to `rollout.max_images` times;
    encoded in trajectory order, each is resized and cut into patches once. A 1920x1080
    screenshot's patches are ~13 MB: the cache holds a few, not the update's."""

    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self.hits = 0  # images served from the cache
        self._items: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def get(self, key: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
            self.hits += 1
        return item

    def put(self, key: bytes, item: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._items[key] = item
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()
        self.hits = 0


def prompt_parts(
    policy: Policy,
    messages: list[Message],
    *,
    ids: list[int] | None = None,
    image_cache: ImageCache | None = None,
) -> PromptParts:
    """Token ids of one prompt with image pads expanded, plus its images' patches/grids.

    `ids`: the prompt's token ids as the serving process tokenized it (`Step.prompt_token_ids`,
    image pads expanded or one per image): the trainer trains on them instead of tokenizing
    `messages` again (the inference environment may pin another tokenizer version, whose chat
    template renders the same messages to other ids). The images still come from `messages`;
    their token counts must be the ones `ids` hold, else ValueError (the processor changed).
    `image_cache`: screenshots already encoded (by content), reused and added to."""
    qwen_messages, urls = _qwen_layout(messages)
    template_ids = list(ids) if ids else _template_ids(policy, qwen_messages)
    if not urls:
        return PromptParts(ids=template_ids, patches=None, image_grid_thw=None)
    patches, grid, keys = _image_patches(policy, urls, image_cache)
    per_image = (grid.prod(-1) // policy.image_processor.merge_size**2).tolist()
    pad = policy.token_id("<|image_pad|>")
    pads = template_ids.count(pad)
    if ids and pads == sum(per_image) and pads != len(urls):  # expanded by the server
        return PromptParts(ids=template_ids, patches=patches, image_grid_thw=grid, image_keys=keys)
    if pads != len(urls):
        where = "the stored prompt ids have" if ids else "prompt has"
        raise ValueError(
            f"{where} {pads} image tokens for {len(urls)} images of {sum(per_image)} tokens"
        )
    expanded: list[int] = []
    counts = iter(per_image)
    for tid in template_ids:
        expanded.extend([pad] * next(counts) if tid == pad else [tid])
    return PromptParts(ids=expanded, patches=patches, image_grid_thw=grid, image_keys=keys)


def _image_patches(
    policy: Policy, urls: list[tuple[Any, str]], cache: ImageCache | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[bytes, ...]]:
    """The patches (concatenated, in order), grids [N, 3] and content keys (the data URLs'
    digests) of the images at `urls` ((data URL, field) pairs): resized and cut only, the values the resized uint8 pixels (exact in
    float32; PixelNorm does the rest where the model is). Only the images not in `cache` are
    decoded and processed; the processor treats each image on its own, so images encoded
    apart concatenate to what one call over all of them gives."""
    keys = [hashlib.sha1(str(url).encode()).digest() for url, _ in urls]
    found = {k: item for k in set(keys) if cache is not None and (item := cache.get(k))}
    missing = [i for i, key in enumerate(keys) if key not in found]
    if missing:
        processed = policy.image_processor(
            images=[_decode_data_url(urls[i][0], where=urls[i][1]) for i in missing],
            return_tensors="pt",
            do_rescale=False,
            do_normalize=False,
        )
        grids = processed["image_grid_thw"]
        rows = processed["pixel_values"].to(torch.uint8).split(grids.prod(-1).tolist())
        for j, i in enumerate(missing):
            found[keys[i]] = (rows[j], grids[j : j + 1])
            if cache is not None:
                cache.put(keys[i], found[keys[i]])
    parts = [found[key] for key in keys]
    return torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts]), tuple(keys)


def _keys_of(prompts: list[PromptParts]) -> tuple[bytes, ...]:
    """The prompts' images' content keys in order, or () unless every image has one."""
    keys = tuple(k for p in prompts for k in p.image_keys)
    images = sum(0 if p.image_grid_thw is None else len(p.image_grid_thw) for p in prompts)
    return keys if len(keys) == images else ()


def encode_batch(
    policy: Policy,
    conversations: list[list[Message]],
    *,
    responses: list[list[int]] | None = None,
) -> EncodedBatch:
    """Left-pad B prompts (each optionally followed by its response token ids) into a batch."""
    parts = [prompt_parts(policy, messages) for messages in conversations]
    return batch_from_parts(policy, parts, responses=responses)


def batch_from_parts(
    policy: Policy,
    prompts: list[PromptParts],
    *,
    responses: list[list[int]] | None = None,
) -> EncodedBatch:
    """Left-pad B encoded prompts (each optionally followed by its response token ids)."""
    pad_id = policy.tokenizer.pad_token_id
    pad = policy.token_id("<|image_pad|>")
    rows: list[list[int]] = []
    resp_lens: list[int] = []
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    for b, prompt in enumerate(prompts):
        response = responses[b] if responses is not None else []
        rows.append(prompt.ids + list(response))
        resp_lens.append(len(response))
        if prompt.patches is not None and prompt.image_grid_thw is not None:
            pixels.append(prompt.patches)
            grids.append(prompt.image_grid_thw)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[b, width - len(row) :] = 1
        if resp_lens[b]:
            response_mask[b, width - resp_lens[b] :] = True
    mm_token_type_ids = ((input_ids == pad) & attention_mask.bool()).long()
    return EncodedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=mm_token_type_ids,
        patches=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        response_mask=response_mask,
        pixel_norm=PixelNorm.of(policy.image_processor) if pixels else None,
        image_keys=_keys_of(prompts),
    )


@dataclass
class PackedBatch:
    """B conversations packed into one row without padding (N images in total): each
    sequence is its prompt then its response, the sequences back to back in order.

    row: the model inputs as one row of L = sum(lengths) tokens: input_ids,
    mm_token_type_ids, response_mask [1, L] (attention_mask [1, L] all ones: the model is
    given none, the position ids restarting at each sequence keep attention within it),
    patches and image_grid_thw [N, 3] as `EncodedBatch` holds them, in sequence order.
    lengths: [B] tokens of each sequence; responses: [B] response tokens of each (its last
    ones); images: [B] images of each sequence.
    """

    row: EncodedBatch
    lengths: list[int]
    responses: list[int]
    images: list[int]

    def to(self, device: torch.device | str) -> PackedBatch:
        return dataclasses.replace(self, row=self.row.to(device))


def pack_parts(
    policy: Policy, prompts: list[PromptParts], *, responses: list[list[int]]
) -> PackedBatch:
    """Pack B encoded prompts, each followed by its response token ids, into one row."""
    pad = policy.token_id("<|image_pad|>")
    ids: list[int] = []
    in_response: list[bool] = []
    for prompt, response in zip(prompts, responses, strict=True):
        if not prompt.ids:  # its first response token would be predicted from the sequence before
            raise ValueError("pack_parts: every sequence needs a prompt before its response")
        ids += prompt.ids + list(response)
        in_response += [False] * len(prompt.ids) + [True] * len(response)
    input_ids = torch.tensor([ids], dtype=torch.long)
    patches = [p.patches for p in prompts if p.patches is not None]
    grids = [p.image_grid_thw for p in prompts if p.image_grid_thw is not None]
    row = EncodedBatch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == pad).long(),
        patches=torch.cat(patches) if patches else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        response_mask=torch.tensor([in_response], dtype=torch.bool),
        pixel_norm=PixelNorm.of(policy.image_processor) if patches else None,
        image_keys=_keys_of(prompts),
    )
    return PackedBatch(
        row=row,
        lengths=[len(p.ids) + len(r) for p, r in zip(prompts, responses, strict=True)],
        responses=[len(r) for r in responses],
        images=[0 if p.image_grid_thw is None else len(p.image_grid_thw) for p in prompts],
    )


def encode_prompt(policy: Policy, messages: list[Message]) -> EncodedBatch:
    """Model inputs for one conversation (B = 1), ending with `<|im_start|>assistant\\n`."""
    return encode_batch(policy, [messages])


def response_token_ids(policy: Policy, response_text: str) -> list[int]:
    """The tokens of `response_text` followed by <|im_end|>, as training sees a response."""
    ids = policy.tokenizer(response_text, add_special_tokens=False)["input_ids"]
    return [*ids, policy.token_id("<|im_end|>")]


def encode_prompt_response(
    policy: Policy,
    messages: list[Message],
    response_text: str | None = None,
    *,
    token_ids: list[int] | None = None,
) -> tuple[EncodedBatch, torch.Tensor]:
    """Inputs for prompt + response (B = 1) and the response mask [1, T].

    The response is `response_text` tokenized and followed by <|im_end|>, or, when given,
    the rollout's exact `token_ids` (Generation.token_ids). Prefer the token ids: a sampled
    sequence need not be the canonical BPE split of its text (random models rarely are).
    """
    if token_ids is None:
        if response_text is None:
            raise ValueError("encode_prompt_response needs response_text or token_ids")
        token_ids = response_token_ids(policy, response_text)
    batch = encode_batch(policy, [messages], responses=[list(token_ids)])
    return batch, batch.response_mask
