"""Model I/O shared by the rollout workers and the trainer, so both tokenize alike.

Messages use the OpenAI chat-completions format (content a string or a list of
`{"type": "text", "text": ...}` / `{"type": "image_url", "image_url": {"url": "data:..."}}`).
`to_qwen_messages` turns them into the Qwen2-VL chat-template form plus the ordered images.

A prompt is `chat_template(messages, add_generation_prompt=True)` tokenized without extra
special tokens, each `<|image_pad|>` expanded to the image's token count. A response is
the sampled tokens, ending with `<|im_end|>` when the model stopped. `generate` (rollout)
and `encode_prompt_response` / `sequence_logprobs` (training) share these functions.

Log-probs and entropies are always those of the model's own distribution, softmax(logits)
at temperature 1 with no top-p cut, whatever temperature/top_p sampled the token: the
trainer recomputes exactly that quantity, so the two can be compared token by token
(truncated importance sampling). Works for the tiny policy (Qwen3-VL architecture, patch 14)
and for any local Qwen2-VL / Qwen2.5-VL checkpoint (e.g. UI-TARS-1.5-7B); nothing is
downloaded. Released Qwen3-VL checkpoints use 16 px patches (32 px per image token), which
rollout's coordinate mapping (`core.actions.IMAGE_FACTOR` = 28) does not follow yet.
"""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from PIL import Image
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from core.imaging import ImageGeometry
from core.lora import adapter_base, attach_adapter, is_adapter_dir, swap_adapter

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

__all__ = [
    "EncodedBatch",
    "Generation",
    "Policy",
    "encode_batch",
    "encode_prompt",
    "encode_prompt_response",
    "generate",
    "load_policy",
    "load_weights_into",
    "save_checkpoint",
    "sequence_logprobs",
    "to_qwen_messages",
]

Message = dict[str, Any]
_MODEL_CLASSES: dict[str, Any] = {
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen3_vl": Qwen3VLForConditionalGeneration,
}


@dataclass
class Policy:
    """A loaded policy: model, tokenizer, image processor and chat template."""

    model: PreTrainedModel  # or a peft PeftModel around one (LoRA: `core.lora`)
    tokenizer: Any
    image_processor: Qwen2VLImageProcessorPil
    chat_template: str
    path: Path  # the directory loaded: a full checkpoint or an adapter
    base: Path | None = None  # the base checkpoint under the weights (path itself when full)

    def __post_init__(self) -> None:
        if self.base is None:
            self.base = self.path

    @property
    def has_adapter(self) -> bool:
        return isinstance(self.model, PeftModel)

    def token_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"tokenizer at {self.path} has no token {token!r}")
        return int(tid)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def image_geometry(self) -> ImageGeometry:
        """The image processor's geometry: rollout maps coordinates with it."""
        return ImageGeometry.from_processor_config(
            self.image_processor.to_dict(), where=f"{self.path}/preprocessor_config.json"
        )


@dataclass
class EncodedBatch:
    """Left-padded model inputs for B conversations (N images in total).

    input_ids, attention_mask, mm_token_type_ids: [B, T] (mm type 1 = image token);
    pixel_values: [P, C*2*14*14] flattened patches of all images or None;
    image_grid_thw: [N, 3] or None; response_mask: [B, T] bool, True on response tokens
    (all False for prompts only).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    response_mask: torch.Tensor

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward / generate."""
        out: dict[str, torch.Tensor] = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "mm_token_type_ids": self.mm_token_type_ids,
        }
        if self.pixel_values is not None and self.image_grid_thw is not None:
            out["pixel_values"] = self.pixel_values
            out["image_grid_thw"] = self.image_grid_thw
        return out

    def to(self, device: torch.device | str) -> EncodedBatch:
        def move(t: torch.Tensor | None) -> Any:
            return None if t is None else t.to(device)

        return EncodedBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))


@dataclass
class Generation:
    """One sampled response.

    token_ids include the stop token (<|im_end|>) when finish_reason == "stop"; `text` never
    does. token_logprobs[i] = log p(token_ids[i]) under the model at temperature 1 (no top-p);
    mean_entropy = mean over token_ids of the full next-token distribution's entropy (nats).
    top_logprobs[i] = the k most likely (token_id, logprob) at step i when asked for.
    """

    text: str
    token_ids: list[int]
    token_logprobs: list[float]
    mean_entropy: float
    prompt_tokens: int
    response_tokens: int
    finish_reason: str
    top_logprobs: list[list[tuple[int, float]]] | None = None


# ---------------------------------------------------------------- loading and saving


def load_policy(
    path: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None
) -> Policy:
    """Load a Qwen2-VL / Qwen2.5-VL directory (tiny policy or e.g. UI-TARS-1.5-7B), locally;
    or a LoRA adapter directory (`core.lora`): its base, then the adapter attached.

    dtype defaults to float32 on CPU and bfloat16 elsewhere.
    """
    path = Path(path)
    if is_adapter_dir(path):
        policy = load_policy(adapter_base(path), device=device, dtype=dtype)
        policy.model = attach_adapter(policy.model, path)  # type: ignore[assignment]
        policy.model.eval()
        policy.path = path
        return policy
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    model_type = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    if model_type not in _MODEL_CLASSES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not one of {sorted(_MODEL_CLASSES)}"
        )
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # No device_map: weights go to one device here (sharding is the trainer's business).
    model = _MODEL_CLASSES[model_type].from_pretrained(path, local_files_only=True, dtype=dtype)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    # The PIL image processor: the default one needs torchvision, which has no CPU build here.
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    return Policy(
        model=model,
        tokenizer=tokenizer,
        image_processor=image_processor,
        chat_template=_find_chat_template(path, tokenizer),
        path=path,
    )


def _find_chat_template(path: Path, tokenizer: Any) -> str:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text())["chat_template"]
    return tokenizer.chat_template or QWEN2_VL_CHAT_TEMPLATE


def save_checkpoint(
    policy: Policy, out_dir: str | Path, *, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write weights, tokenizer, image processor and chat template; loadable by load_policy.
    `state_dict`: the weights to write when the model holds only a shard of them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(out, state_dict=state_dict)
    policy.tokenizer.save_pretrained(out)
    policy.image_processor.save_pretrained(out)
    (out / "chat_template.json").write_text(
        json.dumps({"chat_template": policy.chat_template}, indent=2) + "\n"
    )
    return out


@torch.no_grad()
def load_weights_into(policy: Policy, checkpoint_dir: str | Path) -> None:
    """Copy the weights of `checkpoint_dir` (same architecture) into policy.model in place.
    An adapter directory swaps only the adapter (`core.lora`); a full checkpoint after an
    adapter drops the adapter first.

    The checkpoint is loaded through from_pretrained (which maps saved key names to module
    names) on the CPU, then copied into the live parameters (on whatever device they are);
    peak host memory is one extra copy of the weights. Raises ValueError when the architectures differ.
    """
    if is_adapter_dir(checkpoint_dir):
        _load_adapter_into(policy, Path(checkpoint_dir))
        return
    if isinstance(policy.model, PeftModel):  # a full checkpoint after adapters: plain again
        policy.model = policy.model.unload()
    model = policy.model
    fresh = type(model).from_pretrained(  # type: ignore[attr-defined]
        checkpoint_dir, local_files_only=True, dtype=next(model.parameters()).dtype
    )
    if fresh.config.to_dict() != model.config.to_dict():
        diff = _config_diff(fresh.config.to_dict(), model.config.to_dict())
        if diff:
            raise ValueError(f"{checkpoint_dir} has another architecture: {diff}")
    missing, unexpected = model.load_state_dict(fresh.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint_dir}: weights do not match the model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    del fresh
    policy.path = policy.base = Path(checkpoint_dir)


def _load_adapter_into(policy: Policy, adapter_dir: Path) -> None:
    """Swap the adapter in place (or attach it to the plain base); the base must be the one
    the adapter was trained on."""
    base = adapter_base(adapter_dir).resolve()
    assert policy.base is not None
    if base != policy.base.resolve():
        raise ValueError(
            f"{adapter_dir} adapts {base}, but this policy's base is {policy.base.resolve()}"
        )
    if policy.has_adapter:
        swap_adapter(policy.model, adapter_dir)  # type: ignore[arg-type]
    else:
        policy.model = attach_adapter(policy.model, adapter_dir).eval()  # type: ignore[assignment]
    policy.path = adapter_dir


def _config_diff(a: dict, b: dict) -> list[str]:
    ignore = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"}
    return [k for k in sorted(set(a) | set(b)) if k not in ignore and a.get(k) != b.get(k)]


# ---------------------------------------------------------------- encoding


def to_qwen_messages(messages: list[Message]) -> tuple[list[Message], list[Image.Image]]:
    """OpenAI chat messages -> (Qwen2-VL chat-template messages, images in prompt order).

    Images must be inline data URLs (`data:image/png;base64,...`): workers never fetch URLs.
    Raises ValueError naming the offending field.
    """
    out: list[Message] = []
    images: list[Image.Image] = []
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
                url = (part.get("image_url") or {}).get("url")
                images.append(_decode_data_url(url, where=f"{where}.image_url.url"))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"{where} must be a text part or an image_url part")
        out.append({"role": message["role"], "content": parts})
    return out, images


MAX_IMAGE_PIXELS = 4096 * 4096
"""Largest image a request may carry (a 4K screen fits); checked on the header, before the
pixels are decoded, so a small PNG declaring a huge canvas costs nothing."""


def _decode_data_url(url: Any, *, where: str) -> Image.Image:
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


def _template_ids(policy: Policy, qwen_messages: list[Message]) -> list[int]:
    """The chat template's token ids, one `<|image_pad|>` per image."""
    text = policy.tokenizer.apply_chat_template(
        qwen_messages,
        chat_template=policy.chat_template,
        tokenize=False,
        add_generation_prompt=True,
    )
    return policy.tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt_ids(
    policy: Policy, messages: list[Message]
) -> tuple[list[int], list[Image.Image], torch.Tensor | None, torch.Tensor | None]:
    """Token ids of one prompt with image pads expanded, plus its images' patches/grids."""
    qwen_messages, images = to_qwen_messages(messages)
    ids = _template_ids(policy, qwen_messages)
    if not images:
        return ids, images, None, None
    processed = policy.image_processor(images=images, return_tensors="pt")
    grid = processed["image_grid_thw"]
    per_image = (grid.prod(-1) // policy.image_processor.merge_size**2).tolist()
    pad = policy.token_id("<|image_pad|>")
    if ids.count(pad) != len(images):
        raise ValueError(f"prompt has {ids.count(pad)} image slots for {len(images)} images")
    expanded: list[int] = []
    counts = iter(per_image)
    for tid in ids:
        expanded.extend([pad] * next(counts) if tid == pad else [tid])
    return expanded, images, processed["pixel_values"], grid


def encode_batch(
    policy: Policy,
    conversations: list[list[Message]],
    *,
    responses: list[list[int]] | None = None,
) -> EncodedBatch:
    """Left-pad B prompts (each optionally followed by its response token ids) into a batch."""
    pad_id = policy.tokenizer.pad_token_id
    pad = policy.token_id("<|image_pad|>")
    rows: list[list[int]] = []
    resp_lens: list[int] = []
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    for b, messages in enumerate(conversations):
        ids, _, pv, grid = _prompt_ids(policy, messages)
        response = responses[b] if responses is not None else []
        rows.append(ids + list(response))
        resp_lens.append(len(response))
        if pv is not None and grid is not None:
            pixels.append(pv)
            grids.append(grid)
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
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        response_mask=response_mask,
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


# ---------------------------------------------------------------- generation


class _PerRowSampler(LogitsProcessor):
    """Samples each row with its own temperature, top-p and seeded generator, then hands
    generate() a one-hot score, so one batched greedy generate serves mixed requests."""

    def __init__(
        self,
        *,
        temperatures: list[float],
        top_ps: list[float],
        seeds: list[int | None],
        suppressed: list[int] = (),  # type: ignore[assignment]
    ):
        self.suppressed = list(suppressed)
        self.temperatures = temperatures
        self.top_ps = top_ps
        self.generators = []
        for seed in seeds:
            g = torch.Generator()
            g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
            self.generators.append(g)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        chosen = torch.empty(scores.shape[0], dtype=torch.long)
        # A copy: `scores` may be the very tensor generate() returns as the raw logits that
        # the recorded log-probs come from.
        logits = scores.float().cpu().clone()
        if self.suppressed:
            logits[:, self.suppressed] = -math.inf
        for b in range(scores.shape[0]):
            t = self.temperatures[b]
            if t <= 0:
                chosen[b] = logits[b].argmax()
                continue
            probs = torch.softmax(logits[b] / t, dim=-1)
            if self.top_ps[b] < 1.0:
                sorted_p, order = probs.sort(descending=True)
                # Keep the smallest prefix whose mass reaches top_p (at least one token).
                drop = sorted_p.cumsum(0) - sorted_p >= self.top_ps[b]
                sorted_p[drop] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            chosen[b] = torch.multinomial(probs, 1, generator=self.generators[b])[0]
        out = torch.full_like(scores, -math.inf)
        out[torch.arange(scores.shape[0]), chosen.to(scores.device)] = 0.0
        return out


class _RowLimits(StoppingCriteria):
    """Ends each row at its own max_new_tokens, so a short request's row stops early."""

    def __init__(self, *, prompt_width: int, limits: list[int]):
        self.prompt_width = prompt_width
        self.limits = torch.tensor(limits)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_width
        return (generated >= self.limits).to(input_ids.device)


# Structural tokens a reply must never contain: sampled, they would turn into image slots
# or new turns when the reply is fed back as history (and break the trainer's forward).
NEVER_GENERATED = (
    "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>",
)  # fmt: skip


def never_generated_ids(policy: Policy) -> list[int]:
    ids = []
    for token in NEVER_GENERATED:
        tid = policy.tokenizer.convert_tokens_to_ids(token)
        if tid is not None and tid != policy.tokenizer.unk_token_id:
            ids.append(int(tid))
    return ids


@torch.no_grad()
def generate(
    policy: Policy,
    batch_of_messages: list[list[Message]],
    *,
    max_new_tokens: int | list[int],
    temperature: float | list[float] = 1.0,
    top_p: float | list[float] = 1.0,
    seed: int | list[int | None] | None = None,
    greedy: bool = False,
    top_logprobs: int = 0,
) -> list[Generation]:
    """Sample one response per conversation in one left-padded batched generate.

    max_new_tokens / temperature / top_p / seed may be per row (lists of length B);
    temperature 0 or greedy=True takes the argmax. A row stops at <|im_end|> (or
    <|endoftext|>) or after its max_new_tokens (finish_reason "length"). The batch runs
    until its last row stops (static batching: a long row delays its batch-mates).
    """
    n = len(batch_of_messages)
    limits = [int(v) for v in _per_row(max_new_tokens, n, "max_new_tokens")]  # type: ignore[arg-type]
    temps = _per_row(0.0 if greedy else temperature, n, "temperature")
    top_ps = _per_row(top_p, n, "top_p")
    seeds = seed if isinstance(seed, list) else [seed] * n
    if len(seeds) != n:
        raise ValueError(f"seed has {len(seeds)} entries for {n} conversations")
    batch = encode_batch(policy, batch_of_messages).to(policy.device)
    stop_ids = [policy.token_id("<|im_end|>"), policy.tokenizer.pad_token_id]
    config = GenerationConfig(
        max_new_tokens=max(limits),
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=policy.tokenizer.pad_token_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    sampler = _PerRowSampler(
        temperatures=temps, top_ps=top_ps, seeds=seeds, suppressed=never_generated_ids(policy)
    )
    out = policy.model.generate(  # type: ignore[operator]
        **batch.model_inputs(),
        generation_config=config,
        logits_processor=LogitsProcessorList([sampler]),
        stopping_criteria=StoppingCriteriaList(
            [_RowLimits(prompt_width=batch.input_ids.shape[1], limits=limits)]
        ),
    )
    width = batch.input_ids.shape[1]
    new_tokens = out.sequences[:, width:].cpu()  # [B, S]
    logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, S, V] raw, temperature 1
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # [B, S]
    picked = logp.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B, S]
    top = logp.topk(top_logprobs, dim=-1) if top_logprobs else None
    results = []
    for b in range(n):
        ids = new_tokens[b, : limits[b]].tolist()
        length, finish = len(ids), "length"
        for i, tid in enumerate(ids):
            if tid in stop_ids:
                length, finish = i + 1, "stop"
                break
        ids = ids[:length]
        text_ids = ids[:-1] if finish == "stop" else ids
        results.append(
            Generation(
                text=policy.tokenizer.decode(text_ids, skip_special_tokens=False),
                token_ids=ids,
                token_logprobs=picked[b, :length].tolist(),
                mean_entropy=float(entropy[b, :length].mean()) if length else 0.0,
                prompt_tokens=int(batch.attention_mask[b].sum()),
                response_tokens=length,
                finish_reason=finish,
                top_logprobs=None
                if top is None
                else [
                    list(zip(top.indices[b, i].tolist(), top.values[b, i].tolist(), strict=True))
                    for i in range(length)
                ],
            )
        )
    return results


def _per_row(value: float | list[float], n: int, name: str) -> list[float]:
    values = list(value) if isinstance(value, list) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} conversations")
    return [float(v) for v in values]


# ---------------------------------------------------------------- training forward


def sequence_logprobs(
    model: PreTrainedModel | PeftModel | Policy, batch: EncodedBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward prompt + response; per-token log-probs and entropies, with gradients.

    Returns (token_logprobs [B, T], token_entropy [B, T], mask [B, T] bool), aligned with
    batch.input_ids: token_logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) at
    temperature 1, token_entropy[b, t] the entropy of that distribution; both are 0 where
    mask (= batch.response_mask) is False. Call under torch.no_grad() for reference models.
    """
    if isinstance(model, Policy):
        model = model.model
    batch = batch.to(next(model.parameters()).device)
    mask = batch.response_mask
    width = mask.shape[1]
    # Responses end every (left-padded) row: only their K positions need logits. A real
    # prompt is ~14,000 tokens and the vocabulary ~152,000: all logits would be 4 GB in bf16.
    k = min(width - 1, max(1, int(mask.sum(1).max())))
    logits = model(**batch.model_inputs(), use_cache=False, logits_to_keep=k + 1).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, K, V]: tokens T-K..T-1
    targets = batch.input_ids[:, width - k :]
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, K]
    entropy = -(logp.exp() * logp).sum(-1)  # [B, K]
    before = torch.zeros_like(picked[:, :1]).expand(-1, width - k)
    token_logprobs = torch.cat([before, picked], dim=1) * mask
    token_entropy = torch.cat([before, entropy], dim=1) * mask
    return token_logprobs, token_entropy, mask
