"""Grounding pretraining's samples as model inputs and outputs: each sample as the prompt the
rollout builds and the response it should give, the behaviour-cloning and attention losses on
a batch, and the greedy grounding accuracy. `training.pretrain` runs the loop.
"""

from __future__ import annotations

import torch

from core.actions import (
    ActionParseError,
    CoordSpace,
    format_screen_action,
    parse_output,
    to_screen,
)
from core.encoding import encode_batch, response_token_ids
from core.generation import generate, sequence_logprobs
from core.imaging import ImageGeometry
from core.losses import bc_loss
from core.policy import Policy
from core.prompts import HistoryTurn, build_messages
from core.protocol import Action, ActionType
from core.samples import Box, DesktopStep, GroundingSample

Sample = GroundingSample | DesktopStep


def sample_messages(
    sample: Sample, *, geometry: ImageGeometry | None = None, coords: CoordSpace = "pixel"
) -> list[dict]:
    """The prompt rollout builds for this screen: the earlier actions as history turns (a
    desktop step's, as the policy writes them: in the model coordinates of `geometry`), one
    screenshot (the current)."""
    history = []
    if isinstance(sample, DesktopStep) and sample.history:
        if geometry is None:
            raise ValueError("a desktop step with history needs the policy's geometry")
        screen = (sample.width, sample.height)
        history = [
            HistoryTurn.from_output(
                format_screen_action(a, screen_size=screen, geometry=geometry, coords=coords)
            )
            for a in sample.history
        ]
    return build_messages(
        instruction=sample.instruction, history=history, screenshots=[sample.png], max_images=1
    )


def sample_response(sample: Sample, *, coords: CoordSpace, geometry: ImageGeometry) -> str:
    """``Action: <call>`` in model coordinates (a grounding sample: a click on its point)."""
    if isinstance(sample, DesktopStep):
        action = sample.action
    else:
        action = Action(type=ActionType.CLICK, x=sample.x, y=sample.y)
    return format_screen_action(
        action, screen_size=(sample.width, sample.height), geometry=geometry, coords=coords
    )


def predicted_action(
    text: str, *, sample: Sample, coords: CoordSpace, geometry: ImageGeometry
) -> Action | None:
    """The screen-space action a model output takes, or None (unparsable)."""
    try:
        action = parse_output(text, coords=coords).action
    except ActionParseError:
        return None
    model_size = geometry.model_size(width=sample.width, height=sample.height)
    return to_screen(
        action, screen_size=(sample.width, sample.height), model_size=model_size, coords=coords
    )


def predicted_click(
    text: str, *, sample: Sample, coords: CoordSpace, geometry: ImageGeometry
) -> tuple[int, int] | None:
    """The screen pixel a model output clicks, or None (unparsable / not a click)."""
    action = predicted_action(text, sample=sample, coords=coords, geometry=geometry)
    if action is None or action.type != ActionType.CLICK or action.x is None or action.y is None:
        return None
    return int(action.x), int(action.y)


def _inside(point: tuple[int | None, int | None], box: Box) -> bool:
    x, y = point
    return x is not None and y is not None and box[0] <= x < box[2] and box[1] <= y < box[3]


def action_correct(predicted: Action | None, sample: Sample) -> bool:
    """The output does what the sample asks: same action type, each point inside its box,
    the same text, key or direction (a grounding sample: a click inside its box)."""
    if isinstance(sample, GroundingSample):
        target = Action(type=ActionType.CLICK, x=sample.x, y=sample.y)
        boxes: tuple[Box, ...] = (sample.box,)
    else:
        target, boxes = sample.action, sample.boxes
    if predicted is None or predicted.type != target.type:
        return False
    points = [(predicted.x, predicted.y), (predicted.x2, predicted.y2)][: len(boxes)]
    if not all(_inside(p, b) for p, b in zip(points, boxes, strict=True)):
        return False
    if target.type == ActionType.FINISHED:
        return True
    return (predicted.text, predicted.key, predicted.direction) == (
        target.text,
        target.key,
        target.direction,
    )


def bc_batch_loss(
    policy: Policy, samples: list[Sample], *, coords: CoordSpace, geometry: ImageGeometry
) -> torch.Tensor:
    """Mean negative log-likelihood of the target responses (scalar, with gradient)."""
    responses = [
        response_token_ids(policy, sample_response(s, coords=coords, geometry=geometry))
        for s in samples
    ]
    messages = [sample_messages(s, geometry=geometry, coords=coords) for s in samples]
    batch = encode_batch(policy, messages, responses=responses)
    logprobs, _, mask = sequence_logprobs(policy, batch)
    return bc_loss(logprobs, mask)


def target_image_tokens(sample: Sample, *, geometry: ImageGeometry) -> list[int]:
    """Raster indices of the image tokens (factor x factor px cells of the model image) that overlap
    the sample's target box (none when the response has no point)."""
    if sample.box is None:
        return []
    mw, mh = geometry.model_size(width=sample.width, height=sample.height)
    sx, sy = mw / sample.width, mh / sample.height
    x0, y0, x1, y1 = (
        sample.box[0] * sx,
        sample.box[1] * sy,
        sample.box[2] * sx,
        sample.box[3] * sy,
    )
    cell = geometry.factor  # one image token per cell x cell px
    cols = mw // cell
    return [
        r * cols + c
        for r in range(mh // cell)
        for c in range(cols)
        if c * cell < x1 and (c + 1) * cell > x0 and r * cell < y1 and (r + 1) * cell > y0
    ]


def attention_supervision_loss(
    attentions: torch.Tensor,
    ids: torch.Tensor,
    *,
    offset: int,
    targets: list[list[int]],
    image_pad: int,
    box_start: int,
    box_end: int,
) -> torch.Tensor:
    """-log(attention mass on the target's image tokens), mean over the queries that write
    the point (from the row's last `<|box_start|>` up to the token before the last
    `<|box_end|>`) and over rows.

    attentions: [B, Tq, Tk], one head's weights for the query positions ids[:, offset:];
    ids: [B, Tk] the full rows; targets[b]: raster indices of row b's target image tokens
    (row b must hold exactly one image). Rows without a point or a target are skipped.

    Raises:
        ValueError: rows have targets but none has a response point to supervise (a loss of
        0 here once hid a bug for a whole 40-minute run: it read the system prompt's example).
    """
    terms = []
    for b, target in enumerate(targets):
        row = ids[b]
        image_pos = (row == image_pad).nonzero().flatten()
        starts = (row == box_start).nonzero().flatten()
        ends = (row == box_end).nonzero().flatten()
        # The last pair is the response's (the system prompt shows the format too).
        if not target or not len(starts) or not len(ends) or starts[-1] < offset:
            continue
        keys = image_pos[torch.tensor(target)]
        queries = torch.arange(int(starts[-1]), int(ends[-1])) - offset
        mass = attentions[b][queries][:, keys].sum(-1)
        terms.append(-(mass + 1e-6).log().mean())
    if terms:
        return torch.stack(terms).mean()
    if any(targets):
        raise ValueError(
            "attention supervision: rows have target image tokens but none has a point "
            f"(<|box_start|>...<|box_end|>) at or after query offset {offset}; "
            "the responses were not found in the rows"
        )
    return attentions.new_zeros(())


def bc_batch_loss_cached(
    policy: Policy,
    samples: list[Sample],
    *,
    coords: CoordSpace,
    geometry: ImageGeometry,
    attention_weight: float = 0.0,
    attention_heads: int = 1,
    parts: dict[str, float] | None = None,
) -> torch.Tensor:
    """`bc_batch_loss` with the shared prompt prefix (system prompt, ~500 of ~560 tokens)
    run once per batch without gradient and reused as a KV cache by every row.

    Same forward values as the plain loss (the prefix sees no image, so its keys/values are
    the same for every row); only the gradient through the prefix's keys/values is left out,
    which makes a step ~5-8x cheaper on CPU. Rows are right-padded after the prefix.

    With `attention_weight` > 0 (needs eager attention) it adds that times
    `attention_supervision_loss` on the last layer's first `attention_heads` heads: while
    the point is written, those heads are taught to look at the target's image tokens. A training-time
    signal only; the checkpoint is the plain architecture. `parts`, when given, receives
    the two terms' values ("bc", "attention").

    Long because it is one batched computation whose tensors feed each other; split, a
    dozen of them would be passed between pieces.
    """
    from transformers import DynamicCache

    responses = [
        response_token_ids(policy, sample_response(s, coords=coords, geometry=geometry))
        for s in samples
    ]
    messages = [sample_messages(s, geometry=geometry, coords=coords) for s in samples]
    enc = encode_batch(policy, messages, responses=responses)
    rows = [enc.input_ids[b][enc.attention_mask[b].bool()] for b in range(len(samples))]
    resp_lens = [len(r) for r in responses]
    first = rows[0]
    prefix_len = min(len(r) for r in rows)
    for r in rows:
        same = (r[:prefix_len] == first[:prefix_len]).int()
        prefix_len = min(prefix_len, int(same.cumprod(0).sum()))
    # The prefix runs on token embeddings only: it must stop before the first image.
    vision_start = (first == policy.token_id("<|vision_start|>")).nonzero().flatten()
    if len(vision_start):
        prefix_len = min(prefix_len, int(vision_start[0]) + 1)
    prefix_len -= 1  # keep at least one token of every row in the suffix
    pad_id = policy.tokenizer.pad_token_id
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
        attn[b, : len(r)] = 1
        resp_mask[b, len(r) - resp_lens[b] : len(r)] = True
    image_pad = policy.token_id("<|image_pad|>")
    mm = ((ids == image_pad) & attn.bool()).long()
    model = policy.model
    position_ids, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=mm, image_grid_thw=enc.image_grid_thw, attention_mask=attn
    )
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model.model.language_model(
            inputs_embeds=model.model.get_input_embeddings()(ids[:1, :prefix_len]),
            position_ids=position_ids[:, :1, :prefix_len],
            past_key_values=cache,
            use_cache=True,
        )
        cache.batch_repeat_interleave(len(rows))
    out = model(
        input_ids=ids[:, prefix_len:],
        attention_mask=attn,
        position_ids=position_ids[:, :, prefix_len:],
        past_key_values=cache,
        mm_token_type_ids=mm[:, prefix_len:],
        pixel_values=enc.pixel_values(),
        image_grid_thw=enc.image_grid_thw,
        use_cache=True,
        output_attentions=attention_weight > 0,
    )
    logits = out.logits[:, :-1].float()  # position t predicts token t + 1
    targets = ids[:, prefix_len + 1 :]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = bc = bc_loss(logp, resp_mask[:, prefix_len + 1 :])
    if attention_weight > 0:
        if not out.attentions:
            raise ValueError("attention supervision needs eager attention (no weights returned)")
        target_tokens = [target_image_tokens(s, geometry=geometry) for s in samples]
        per_head = [
            attention_supervision_loss(
                out.attentions[-1][:, head],
                ids,
                offset=prefix_len,
                targets=target_tokens,
                image_pad=image_pad,
                box_start=policy.token_id("<|box_start|>"),
                box_end=policy.token_id("<|box_end|>"),
            )
            for head in range(attention_heads)
        ]
        attention = torch.stack(per_head).mean()
        if parts is not None:
            parts["attention"] = attention.item()
        loss = loss + attention_weight * attention
    if parts is not None:
        parts["bc"] = bc.item()
    return loss


@torch.no_grad()
def grounding_accuracy(
    policy: Policy,
    samples: list[Sample],
    *,
    coords: CoordSpace,
    geometry: ImageGeometry,
    batch_size: int = 16,
) -> dict[str, float]:
    """Greedy outputs on `samples`: fraction doing what the sample asks (`action_correct`:
    a click inside the target box, a desktop step's action), overall and per source, plus
    the parse rate."""
    policy.model.eval()
    hits: dict[str, list[bool]] = {}
    parsed = 0
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        prompts = [sample_messages(s, geometry=geometry, coords=coords) for s in chunk]
        outs = generate(policy, prompts, max_new_tokens=40, greedy=True)
        for s, out in zip(chunk, outs, strict=True):
            action = predicted_action(out.text, sample=s, coords=coords, geometry=geometry)
            parsed += action is not None
            hits.setdefault(s.source, []).append(action_correct(action, s))
    flat = [h for v in hits.values() for h in v]
    result = {"accuracy": sum(flat) / max(1, len(flat)), "parse_rate": parsed / max(1, len(flat))}
    result.update({src: sum(v) / len(v) for src, v in sorted(hits.items())})
    return result
