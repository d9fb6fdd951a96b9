"""Micro-batches formed by tokens, their sequences packed in one row without padding: the
trainer scores and trains a packed micro-batch as the left-padded one (fp32, both trained
architectures), and the micro-batches hold the token budget and the sample cap."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image, ImageDraw

from core.encoding import (
    batch_from_parts,
    pack_parts,
    prompt_length,
    prompt_parts,
    response_token_ids,
)
from core.generation import packed_logprobs, sequence_logprobs
from core.policy import Policy, load_policy
from core.samples import TrainSample
from training.config import CurationConfig, TrainerConfig
from training.micro_batches import micro_batches
from training.tiny_policy import build_tiny_policy
from training.trainer import PolicyTrainer

CURATION = CurationConfig(high_entropy=False)  # every step trains

# Steps of different lengths: (screenshots as (width, height), instruction, reply).
STEPS = [
    ([(160, 210)], "Click the submit button.", "Action: click(start_box='(12,40)')"),
    ([(320, 240), (160, 210), (200, 120)], "Type hello in the search box, then press enter.",
     "Thought: the search box is at the top, I type there.\nAction: type(content='hello')"),
    ([], "Scroll down the page.", "Action: scroll(start_box='(5,5)', direction='down')"),
    ([(200, 120), (240, 320)], "Drag the slider to the right.", "Thought: drag.\nAction: wait()"),
    ([(96, 96)], "Open the file menu.", "Thought: the menu is at the top left of the window.\n"
     "Action: click(start_box='(3,4)')"),
]  # fmt: skip


def screenshot(width: int, height: int, shade: int) -> str:
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).rectangle([4, 8, width // 2, height // 3], fill=(shade, 40, 200))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def step_samples(policy: Policy) -> list[TrainSample]:
    """Two tasks, a success and failures in each, steps of 0 to 3 screenshots; the rollout's
    log-probs differ from the policy's, so the IS weights vary from token to token."""
    out = []
    for i, (screens, instruction, reply) in enumerate(STEPS):
        content: list[dict[str, Any]] = [{"type": "text", "text": instruction}]
        reply_ids = response_token_ids(policy, reply)
        content += [
            {"type": "image_url", "image_url": {"url": screenshot(w, h, 50 * k + 10 * i)}}
            for k, (w, h) in enumerate(screens)
        ]
        out.append(
            TrainSample(
                step_id=i + 1,
                trajectory_id=i + 1,
                group_id=i % 2,
                messages=[
                    {"role": "system", "content": "You are a GUI agent."},
                    {"role": "user", "content": content},
                ],
                response_text=reply,
                reward=float(i < 2),
                rollout_logprobs=[-6.5] * len(reply_ids),
                mean_entropy=1.0,
                policy_version=0,
                response_token_ids=reply_ids,
            )
        )
    return out


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def checkpoint(request, tmp_path_factory) -> Path:
    """A tiny policy of each architecture the project trains (the shipped one is Qwen3-VL,
    UI-TARS Qwen2.5-VL)."""
    return build_tiny_policy(
        tmp_path_factory.mktemp(request.param) / "m", arch=request.param,
        hidden=64, layers=2, intermediate=128, vision_hidden=32,
    )  # fmt: skip


class GradientRecorder(torch.optim.Optimizer):
    """Takes no step: keeps the gradients the update hands it (after clipping, which a
    grad_clip of 1e6 leaves as they are)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.0})
        self.grads: list[torch.Tensor] = []

    def step(self, closure: Any = None) -> None:
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]


def trainer(checkpoint: Path, run_dir: Path, *, pack: bool, **settings: Any) -> PolicyTrainer:
    config = TrainerConfig(**{"kl_coef": 0.1, "grad_clip": 1e6, **settings})
    out = PolicyTrainer(config=config, start_checkpoint=checkpoint, run_dir=run_dir, pack=pack)
    out.optimizer = GradientRecorder(out.trainable_parameters())
    return out


def micro_batches_scored(t: PolicyTrainer) -> list[list[int]]:
    """Record the step ids of each logprob_fn call of `t` from now on."""
    calls: list[list[int]] = []
    scored = t.logprob_fn

    def recording(model: torch.nn.Module, samples: Any) -> Any:
        calls.append([s.step_id for s in samples])
        return scored(model, samples)

    t.logprob_fn = recording  # type: ignore[method-assign]
    return calls


def test_a_packed_micro_batch_scores_and_trains_as_the_padded_one(checkpoint, tmp_path) -> None:
    packed = trainer(checkpoint, tmp_path / "packed", pack=True, micro_batch_tokens=400)
    padded = trainer(checkpoint, tmp_path / "padded", pack=False, micro_batch_tokens=400)
    samples = step_samples(packed.policy)
    with torch.no_grad():
        lp_packed, ent_packed, mask_packed = packed.logprob_fn(packed.policy.model, samples)
        lp_padded, ent_padded, mask_padded = padded.logprob_fn(padded.policy.model, samples)
    assert mask_packed.sum() == mask_padded.sum() > 0
    assert (lp_packed[mask_packed] - lp_padded[mask_padded]).abs().max() < 1e-5
    assert (ent_packed[mask_packed] - ent_padded[mask_padded]).abs().max() < 1e-5

    calls = micro_batches_scored(packed)
    m_packed = packed.update(samples, CURATION)
    m_padded = padded.update(samples, CURATION)
    # by the budget (106 + 258, then 59 + 182 + 80 tokens), each scored by the policy and
    # the reference: the packed rows held several sequences
    assert calls == [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5]]
    assert m_packed.loss == pytest.approx(m_padded.loss, abs=1e-6) and abs(m_padded.loss) > 1e-3
    assert m_packed.n_tokens == m_padded.n_tokens
    pairs = list(zip(packed.optimizer.grads, padded.optimizer.grads, strict=True))
    assert pairs and any(float(b.abs().max()) > 0 for _, b in pairs)
    for a, b in pairs:
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()) + 1e-9


def test_transformers_block_diagonal_mask_gives_the_same_log_probs(checkpoint) -> None:
    """Packed without `core.text_attention`: SDPA under the mask transformers builds from
    the restarting position ids, exact too (only slower)."""
    policy = load_policy(checkpoint)
    samples = step_samples(policy)
    prompts = [prompt_parts(policy, s.messages) for s in samples]
    responses = [list(s.response_token_ids or ()) for s in samples]
    with torch.no_grad():
        packed, _, mask_packed = packed_logprobs(
            policy.model, pack_parts(policy, prompts, responses=responses)
        )
        padded, _, mask_padded = sequence_logprobs(
            policy.model, batch_from_parts(policy, prompts, responses=responses)
        )
    assert (packed[mask_packed] - padded[mask_padded]).abs().max() < 1e-5


def test_the_token_budget_counts_what_the_packed_row_holds(checkpoint, tmp_path) -> None:
    """The lengths the budget reads (ids and image headers, no image decoded) are the
    encoded prompts' lengths, from the messages or from ids with one pad per image."""
    t = trainer(checkpoint, tmp_path, pack=True)
    pad = t.policy.token_id("<|image_pad|>")
    for sample in step_samples(t.policy):
        parts = prompt_parts(t.policy, sample.messages)
        assert prompt_length(t.policy, sample.messages) == len(parts.ids)
        assert prompt_length(t.policy, sample.messages, ids=parts.ids) == len(parts.ids)
        one_pad_each = [tid for k, tid in enumerate(parts.ids) if tid != pad or
                        (k > 0 and parts.ids[k - 1] != pad)]  # fmt: skip
        assert prompt_length(t.policy, sample.messages, ids=one_pad_each) == len(parts.ids)


def test_micro_batches_hold_the_token_budget_and_the_sample_cap() -> None:
    lengths = [300, 500, 200, 2500, 100, 100, 100, 100, 900, 400]
    groups = micro_batches(lengths, max_tokens=1000, max_samples=3)
    assert [i for g in groups for i in g] == list(range(len(lengths)))  # every one, in order
    assert groups == [[0, 1, 2], [3], [4, 5, 6], [7, 8], [9]]
    for g in groups:
        assert len(g) <= 3
        assert len(g) == 1 or sum(lengths[i] for i in g) <= 1000
    assert micro_batches([5000], max_tokens=1000, max_samples=8) == [[0]]  # alone, not dropped
    assert micro_batches([], max_tokens=1000, max_samples=8) == []


def test_a_step_longer_than_the_budget_trains_in_a_micro_batch_of_its_own(
    checkpoint, tmp_path
) -> None:
    t = trainer(checkpoint, tmp_path, pack=True, micro_batch_tokens=250, kl_coef=0.0)
    samples = step_samples(t.policy)  # step 2: three screenshots, 258 tokens
    calls = micro_batches_scored(t)
    metrics = t.update(samples, CURATION)
    assert calls == [[1], [2], [3, 4], [5]]
    assert metrics.step_kept[2] and metrics.n_tokens == sum(
        len(s.response_token_ids or ()) for s in samples
    )
    assert any(float(g.abs().max()) > 0 for g in t.optimizer.grads)
