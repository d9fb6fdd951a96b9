"""The trainer's real-model modes on the tiny policy: LoRA adapters (only they change, the
reference is the base, a version is a small adapter directory that loads and serves),
gradient checkpointing (the same update), and resume in each mode (continues exactly)."""

from __future__ import annotations

import base64
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from core.lora import is_adapter_dir
from core.policy import load_policy, load_weights_into
from core.samples import TrainSample
from tests.conftest import png_bytes
from training.config import CurationConfig, TrainerConfig
from training.trainer import PolicyTrainer, version_dir

pytestmark = pytest.mark.slow  # trains or loads a policy: 6-35 s a test

LORA = {"lora_rank": 4, "lora_alpha": 8}  # the run's adapter settings
SETTINGS = TrainerConfig(lr=1e-2, kl_coef=0.1, micro_batch=4)
CURATION = CurationConfig(high_entropy=False, truncated_is=False)  # every step, no IS


def samples(seed: int = 0) -> list[TrainSample]:
    """Two task groups of two one-step trajectories each, one success and one failure."""
    url = "data:image/png;base64," + base64.b64encode(png_bytes(64, 48)).decode()
    out = []
    for i in range(4):
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Click button {i // 2 + seed}."},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ]
        out.append(
            TrainSample(
                step_id=100 * seed + i,
                trajectory_id=100 * seed + i,
                group_id=i // 2,
                messages=messages,
                response_text=f"Action: click(start_box='({10 * i},{20 + i})')",
                reward=float(i % 2),
                rollout_logprobs=[],
                mean_entropy=1.0,
                policy_version=0,
            )
        )
    return out


def trainer(
    start: Path,
    run_dir: Path,
    *,
    published_versions: list[int] | None = None,
    prompt_cache_bytes: int = 2 * 1024**3,
    **settings,
) -> PolicyTrainer:
    """A trainer of SETTINGS with `settings` changed."""
    torch.manual_seed(0)  # LoRA's A matrices are random at init
    return PolicyTrainer(
        config=dataclasses.replace(SETTINGS, **settings),
        start_checkpoint=start,
        run_dir=run_dir,
        published_versions=published_versions or [],
        prompt_cache_bytes=prompt_cache_bytes,
    )


def logprobs(t: PolicyTrainer, model: torch.nn.Module, batch: list[TrainSample]) -> torch.Tensor:
    with torch.no_grad():
        values, _, mask = t.logprob_fn(model, batch)
    return values[mask.bool()]


def test_lora_trains_only_the_adapters_and_the_reference_is_the_base(
    tiny_policy_dir, tmp_path
) -> None:
    t = trainer(tiny_policy_dir, tmp_path / "run", **LORA)
    before = {n: p.detach().clone() for n, p in t.policy.model.named_parameters()}
    trainable = {n for n, p in t.policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(before[n].numel() for n in trainable) < 0.05 * sum(
        v.numel() for v in before.values()
    )
    assert not any(".visual." in n for n in trainable)  # the vision tower stays frozen
    batch = samples()
    base_trainer = trainer(tiny_policy_dir, tmp_path / "base", kl_coef=0)
    base = logprobs(base_trainer, base_trainer.policy.model, batch)
    # lora_B starts at zero: before any update the adapted model is the base.
    assert torch.allclose(logprobs(t, t.policy.model, batch), base, atol=1e-5)

    for _ in range(3):
        t.update(batch, CURATION)

    after = dict(t.policy.model.named_parameters())
    changed = [n for n in trainable if not torch.equal(after[n], before[n])]
    assert any("lora_B" in n for n in changed)
    frozen_changed = [n for n in before if n not in trainable and not torch.equal(after[n], before[n])]  # fmt: skip
    assert frozen_changed == []
    # The policy moved; the reference (adapters off, same weights) is still exactly the base.
    assert not torch.allclose(logprobs(t, t.policy.model, batch), base, atol=1e-3)
    assert torch.allclose(logprobs(t, t.ref_model, batch), base, atol=1e-5)


def test_a_lora_version_is_a_small_adapter_directory_that_loads_as_trained(
    tiny_policy_dir, tmp_path
) -> None:
    t = trainer(tiny_policy_dir, tmp_path / "run", **LORA)
    batch = samples()
    t.update(batch, CURATION)
    published = t.save_version(1)
    assert is_adapter_dir(published)
    size = sum(f.stat().st_size for f in published.glob("*.safetensors"))
    full = sum(f.stat().st_size for f in tiny_policy_dir.glob("*.safetensors"))
    assert size < full / 10, (size, full)

    served = load_policy(published)
    assert served.base is not None and served.base.resolve() == tiny_policy_dir.resolve()
    expected = logprobs(t, t.policy.model, batch)
    assert torch.allclose(logprobs(t, served.model, batch), expected, atol=1e-5)

    # Swapped in place into a live model that serves the base: the same numbers.
    live = load_policy(tiny_policy_dir)
    load_weights_into(live, published)
    assert torch.allclose(logprobs(t, live.model, batch), expected, atol=1e-5)
    t.update(batch, CURATION)
    load_weights_into(live, t.save_version(2))  # the second adapter replaces the first
    assert torch.allclose(logprobs(t, live.model, batch), logprobs(t, t.policy.model, batch), atol=1e-5)  # fmt: skip
    load_weights_into(live, tiny_policy_dir)  # full weights again: the adapter is gone
    assert not live.has_adapter


def test_an_adapter_for_another_base_is_refused(tiny_policy_dir, tmp_path) -> None:
    other = Path(shutil.copytree(tiny_policy_dir, tmp_path / "other-base"))
    published = trainer(other, tmp_path / "run", **LORA).save_version(1)
    live = load_policy(tiny_policy_dir)
    with pytest.raises(ValueError, match=r"adapts .*other-base"):
        load_weights_into(live, published)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_resume_continues_exactly(tiny_policy_dir, tmp_path, mode) -> None:
    kwargs = LORA if mode == "lora" else {}
    run = tmp_path / "run"
    first = trainer(tiny_policy_dir, run, **kwargs)
    first.update(samples(0), CURATION)
    first.save_version(1)
    first.update(samples(1), CURATION)
    expected = {n: p.detach().clone() for n, p in first.policy.model.named_parameters()}

    resumed = trainer(tiny_policy_dir, run, published_versions=[1], **kwargs)
    assert resumed.state.version == 1 and resumed.state.updates == 1
    resumed.update(samples(1), CURATION)
    got = dict(resumed.policy.model.named_parameters())
    assert got.keys() == expected.keys()
    worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
    assert worst < 1e-6, worst


def test_a_lora_run_refuses_to_resume_from_full_weights(tiny_policy_dir, tmp_path) -> None:
    run = tmp_path / "run"
    trainer(tiny_policy_dir, run).save_version(1)
    with pytest.raises(ValueError, match="holds full weights, but this run trains LoRA"):
        trainer(tiny_policy_dir, run, published_versions=[1], **LORA)
    assert version_dir(run, 1).is_dir()


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_gradient_checkpointing_gives_the_same_update(tiny_policy_dir, tmp_path, mode) -> None:
    kwargs = LORA if mode == "lora" else {}
    plain = trainer(tiny_policy_dir, tmp_path / "a", **kwargs)
    recomputed = trainer(tiny_policy_dir, tmp_path / "b", gradient_checkpointing="on", **kwargs)
    base_model = recomputed.policy.model
    if mode == "lora":
        base_model = base_model.get_base_model()
    assert base_model.is_activation_checkpointing
    metrics = [t.update(samples(), CURATION) for t in (plain, recomputed)]
    assert metrics[0].loss == pytest.approx(metrics[1].loss, abs=1e-6)
    a = dict(plain.policy.model.named_parameters())
    b = dict(recomputed.policy.model.named_parameters())
    assert max((a[n] - b[n]).abs().max().item() for n in a) < 1e-6


def test_an_update_encodes_each_step_once_and_takes_the_step_it_took_encoding_every_pass(
    tiny_policy_dir, tmp_path
):
    """The trainer encodes a step's prompt once per update, runs the frozen vision tower once
    per screenshot and skips the separate pi_old pass; the adapters come out as they do
    when every pass encodes everything again (the baseline bench/update_cost.py measures)."""
    other = "data:image/png;base64," + base64.b64encode(png_bytes(96, 64, (30, 90, 200))).decode()
    second = [  # another screen in the second micro-batch: its features are its own
        dataclasses.replace(s, messages=[{**s.messages[0], "content": [
            s.messages[0]["content"][0], {"type": "image_url", "image_url": {"url": other}}]}])
        for s in samples(1)
    ]  # fmt: skip
    batch = [*samples(0), *second]
    again = trainer(tiny_policy_dir, tmp_path / "again", **LORA, prompt_cache_bytes=0)
    once = trainer(tiny_policy_dir, tmp_path / "once", **LORA)
    assert once.vision_frozen
    for _ in range(2):
        slow = again.update(batch, CURATION, separate_old_pass=True)
        fast = once.update(batch, CURATION)
    assert (slow.passes, fast.passes) == ("old+ref+grad", "ref+grad")
    assert (slow.encode_reused, slow.image_features_reused) == (0, 0)
    # 8 steps in 2 micro-batches of 4: each step encoded for the reference pass, reused by
    # the gradient pass; each of the two screens through the tower once (the 8 steps show
    # them 16 times over the two passes: 14 reused).
    assert (fast.encode_reused, fast.image_features_reused) == (8, 14)
    assert fast.loss == pytest.approx(slow.loss, rel=1e-5)
    trained = dict(once.policy.model.named_parameters())
    for name, value in again.policy.model.named_parameters():
        # The tower encodes each screen once rather than with the batch's copies of it: float
        # noise in its output (1e-7), which AdamW, dividing each gradient by its own size,
        # can make a visible part of a step on near-zero gradients: a tenth of one lr step.
        assert torch.allclose(value, trained[name], atol=1e-3), name


def test_the_prompt_cache_keeps_what_its_bytes_allow_and_nothing_at_zero(tiny_policy_dir):
    from training.prompt_cache import PromptCache

    policy = load_policy(tiny_policy_dir)
    first, second = samples(0)[:2]
    one = PromptCache(1 << 30).get(policy, first).nbytes

    def reused(max_bytes: int, order: list) -> int:
        cache = PromptCache(max_bytes)
        for sample in order:
            cache.get(policy, sample)
        return cache.reused

    assert reused(0, [first, first]) == 0  # nothing kept: every pass encodes
    assert reused(one, [first, first]) == 1  # room for one prompt
    assert reused(one, [first, second, first]) == 0  # the second pushed the first out
    assert reused(1 << 30, [first, second, first, second]) == 2


def test_the_prompt_cache_encodes_ahead_on_a_thread_and_no_further_than_asked(tiny_policy_dir):
    """On a GPU the trainer encodes the next steps while the GPU works on this one; the
    prefetch must give the same prompts and stay `ahead` steps in front of the update."""
    import time

    from core.encoding import prompt_parts
    from training.prompt_cache import PromptCache

    policy = load_policy(tiny_policy_dir)
    steps = samples(0)[:4]
    cache = PromptCache(1 << 30)
    cache.prefetch(policy, steps, ahead=2)
    deadline = time.monotonic() + 60
    while len(cache._parts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # room for a third, which it must not take before the update asks
    assert sorted(cache._parts) == sorted(s.step_id for s in steps[:2])
    for step in steps:
        parts = cache.get(policy, step)
        alone = prompt_parts(policy, step.messages)
        assert parts.ids == alone.ids and torch.equal(parts.patches, alone.patches)
    assert cache.reused == 0  # the first ask of a prefetched step is not a reuse
    cache.get(policy, steps[0])
    assert cache.reused == 1
    cache.clear()
    assert cache._thread is None and not cache._parts
