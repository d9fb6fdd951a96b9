"""Sampling a response (rollout) and scoring one (training) with a loaded policy.

Log-probs and entropies are always those of the model's own distribution, softmax(logits)
at temperature 1 with no top-p cut, whatever temperature/top_p sampled the token: the
trainer recomputes exactly that quantity with `sequence_logprobs`, so the two can be
compared token by token (truncated importance sampling).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from core.encoding import EncodedBatch, Message, PackedBatch, encode_batch
from core.lora import base_model
from core.policy import Policy
from core.replies import reply_text, stop_token_ids

if TYPE_CHECKING:
    from peft import PeftModel


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
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)  # image pads expanded


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
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|im_start|>",
)


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
    temperature 0 or greedy=True takes the argmax. A row stops at the checkpoint's end tokens
    (`core.replies.stop_token_ids`) or after its max_new_tokens (finish_reason "length"). The batch runs
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
    stop_ids = stop_token_ids(policy.base or policy.path, policy.tokenizer)
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
    return _generations(
        policy,
        batch,
        new_tokens=out.sequences[:, width:].cpu(),  # [B, S]
        logits=torch.stack(out.logits, dim=1).float().cpu(),  # [B, S, V] raw, temperature 1
        limits=limits,
        stop_ids=stop_ids,
        top_logprobs=top_logprobs,
    )


def _generations(
    policy: Policy,
    batch: EncodedBatch,
    *,
    new_tokens: torch.Tensor,
    logits: torch.Tensor,
    limits: list[int],
    stop_ids: list[int],
    top_logprobs: int,
) -> list[Generation]:
    """Cut each row of new_tokens [B, S] at its stop token or its limit, with the
    temperature-1 log-probs and entropies of the raw logits [B, S, V]."""
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # [B, S]
    prompt_ids = batch.input_ids.cpu()
    prompt_mask = batch.attention_mask.cpu().bool()
    picked = logp.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B, S]
    top = logp.topk(top_logprobs, dim=-1) if top_logprobs else None
    results = []
    for b in range(new_tokens.shape[0]):
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
                text=reply_text(policy.tokenizer, text_ids),
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
                prompt_token_ids=prompt_ids[b][prompt_mask[b]].tolist(),
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
    model: PreTrainedModel | PeftModel | Policy,
    batch: EncodedBatch,
    *,
    image_features: Any | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward prompt + response; per-token log-probs (with gradients) and entropies (none:
    no loss takes the entropy's gradient, and recording it would keep a [B, K, V] tensor per
    micro-batch alive until the backward pass).

    Returns (token_logprobs [B, T], token_entropy [B, T], mask [B, T] bool), aligned with
    batch.input_ids: token_logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) at
    temperature 1, token_entropy[b, t] the entropy of that distribution; both are 0 where
    mask (= batch.response_mask) is False. Call under torch.no_grad() for reference models.
    `image_features`: the vision tower's output for batch.pixel_values(), computed before
    (`get_image_features(..., return_dict=True)`): the images are not encoded again.
    """
    if isinstance(model, Policy):
        model = model.model
    if image_features is not None:  # the tower's output stands in: no pixels to move
        batch = dataclasses.replace(batch, patches=None)
    batch = batch.to(next(model.parameters()).device)
    mask = batch.response_mask
    width = mask.shape[1]
    inputs: dict[str, Any] = dict(batch.model_inputs(pixels=image_features is None))
    if image_features is not None:
        inputs["mm_encoder_outputs"] = {"image": image_features}
    # Responses end every (left-padded) row: only their K positions need logits. A real
    # prompt is ~14,000 tokens and the vocabulary ~152,000: all logits would be 4 GB in bf16.
    k = min(width - 1, max(1, int(mask.sum(1).max())))
    logits = model(**inputs, use_cache=False, logits_to_keep=k + 1).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, K, V]: tokens T-K..T-1
    targets = batch.input_ids[:, width - k :]
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, K]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # [B, K]
    before = torch.zeros_like(picked[:, :1]).expand(-1, width - k)
    token_logprobs = torch.cat([before, picked], dim=1) * mask
    token_entropy = torch.cat([before, entropy], dim=1) * mask
    return token_logprobs, token_entropy, mask


def packed_position_ids(model: PreTrainedModel | PeftModel, packed: PackedBatch) -> torch.Tensor:
    """Position ids [4, 1, L] of a packed row, on the row's device. Row 0: each token's index
    within its own sequence, restarting at 0, which is how transformers finds the sequences
    and keeps each one's attention within it (`masking_utils.find_packed_sequence_indices`,
    the text model's 4-row form); rows 1-3: each sequence's M-RoPE positions (temporal,
    height, width) as the model's `get_rope_index` gives them for that sequence alone, which
    are the positions the same sequence gets in a left-padded batch."""
    inner: Any = base_model(model).model  # the Qwen-VL model under the LM head
    row = packed.row
    grids = row.image_grid_thw
    parts = []
    start = first_image = 0
    for length, n_images in zip(packed.lengths, packed.images, strict=True):
        end = start + length
        mrope, _ = inner.get_rope_index(
            input_ids=row.input_ids[:, start:end],
            mm_token_type_ids=row.mm_token_type_ids[:, start:end],
            image_grid_thw=None if grids is None else grids[first_image : first_image + n_images],
        )  # [3, 1, length]
        text = torch.arange(length, device=mrope.device).view(1, 1, -1)
        parts.append(torch.cat([text, mrope]))
        start, first_image = end, first_image + n_images
    return torch.cat(parts, dim=-1)


def packed_logprobs(
    model: PreTrainedModel | PeftModel | Policy,
    packed: PackedBatch,
    *,
    image_features: Any | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sequence_logprobs` on B sequences packed in one row without padding: the same
    per-token log-probs (with gradients) and entropies (none), each token scored given only
    its own sequence before it.

    Returns (token_logprobs [B, K], token_entropy [B, K], mask [B, K] bool), K the longest
    response: row b's first n_b positions hold sequence b's n_b response tokens in order
    (mask True there), 0 elsewhere. `image_features`: as `sequence_logprobs` takes them.
    """
    if isinstance(model, Policy):
        model = model.model
    positions = packed_position_ids(model, packed)  # on the CPU: a loop over token types
    row = packed.row
    if image_features is not None:  # the tower's output stands in: no pixels to move
        row = dataclasses.replace(row, patches=None)
    device = next(model.parameters()).device
    row = row.to(device)
    inputs: dict[str, Any] = dict(row.model_inputs(pixels=image_features is None))
    # No attention mask: with none, the restarting positions build one that keeps each
    # sequence to itself (block-diagonal causal), where a mask of ones would join them.
    del inputs["attention_mask"]
    inputs["position_ids"] = positions.to(device)
    if image_features is not None:
        inputs["mm_encoder_outputs"] = {"image": image_features}
    targets = row.response_mask[0].nonzero()[:, 0]  # [N] the response tokens' positions
    # Only the positions that predict a response token need logits (each is the one before
    # it: a prompt precedes every response, so it is in the same sequence).
    logits = model(**inputs, use_cache=False, logits_to_keep=targets - 1).logits  # [1, N, V]
    logp = torch.log_softmax(logits[0].float(), dim=-1)  # [N, V]
    picked = logp.gather(-1, row.input_ids[0, targets].unsqueeze(-1)).squeeze(-1)  # [N]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)  # [N]
    counts = torch.tensor(packed.responses, device=device)
    mask = torch.arange(int(counts.max()), device=device)[None, :] < counts[:, None]  # [B, K]
    # Row-major order of mask's True positions is the row's order of response tokens.
    token_logprobs = picked.new_zeros(mask.shape).masked_scatter(mask, picked)
    token_entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
    return token_logprobs, token_entropy, mask
