"""policy_update on a real tiny causal LM (GPT-2 architecture, random init, toy vocabulary)."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from core.samples import TrainSample
from training.config import CurationConfig, TrainerConfig
from training.update import policy_update
from training.update_plan import plan_update

RUN = CurationConfig()  # a run's curation: the entropy filter keeps the top 80%
EVERY_STEP = CurationConfig(high_entropy=False)  # the entropy filter off

VOCAB = "abcdefghijklmnop"  # one token per character


def encode(text: str) -> list[int]:
    return [VOCAB.index(ch) for ch in text]


def tiny_lm(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(VOCAB), n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def toy_logprob_fn(
    model: torch.nn.Module, samples: Sequence[TrainSample]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token log-probs of each response given its prompt (the last message's content)."""
    prompts = [encode(s.messages[-1]["content"]) for s in samples]
    responses = [encode(s.response_text) for s in samples]
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    attention = torch.zeros(len(samples), length, dtype=torch.long)
    mask = torch.zeros(len(samples), length - 1, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        attention[b, : len(p) + len(r)] = 1
        mask[b, len(p) - 1 : len(p) + len(r) - 1] = True  # position t predicts token t + 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    token_logprobs = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    return token_logprobs * mask, entropy * mask, mask


def sample(
    step_id: int, task: int, prompt: str, response: str, reward: float, *,
    trajectory: int | None = None, version: int = 0, entropy: float = 1.0,
    rollout: list[float] | None = None, demo: bool = False,
) -> TrainSample:  # fmt: skip
    return TrainSample(
        step_id=step_id,
        trajectory_id=step_id if trajectory is None else trajectory,
        group_id=task,
        messages=[{"role": "user", "content": prompt}],
        response_text=response,
        reward=reward,
        rollout_logprobs=[] if rollout is None else rollout,
        mean_entropy=entropy,
        policy_version=version,
        is_demo=demo,
    )


def with_rollout_logprobs(model: torch.nn.Module, samples: list[TrainSample]) -> list[TrainSample]:
    """What the inference server would report: the current policy's token log-probs."""
    with torch.no_grad():
        logprobs, _, mask = toy_logprob_fn(model, samples)
    return [
        dataclasses.replace(s, rollout_logprobs=logprobs[b][mask[b]].tolist())
        for b, s in enumerate(samples)
    ]


def response_logprob(model: torch.nn.Module, prompt: str, response: str) -> float:
    with torch.no_grad():
        logprobs, _, mask = toy_logprob_fn(model, [sample(0, 0, prompt, response, 0.0)])
    return float(logprobs[mask].sum())


# Two tasks; each has rewarded and unrewarded responses of different lengths.
GOOD = {1: ("ab", "cdc"), 2: ("ba", "gh")}
BAD = {1: ("ab", "effe"), 2: ("ba", "i")}


def bandit_batch() -> list[TrainSample]:
    batch, step = [], 0
    for task in (1, 2):
        for table, reward in ((GOOD, 1.0), (BAD, 0.0), (GOOD, 1.0), (BAD, 0.0)):
            step += 1
            prompt, response = table[task]
            batch.append(sample(step, task, prompt, response, reward))
    return batch


@pytest.mark.parametrize(
    ("loss_type", "kl_coef"), [("ppo", 0.0), ("gspo", 0.0), ("ppo", 0.05)]
)  # fmt: skip
def test_policy_update_raises_rewarded_and_lowers_unrewarded_responses(
    loss_type: str, kl_coef: float
) -> None:
    model = tiny_lm()
    ref = copy.deepcopy(model).requires_grad_(False) if kl_coef else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = TrainerConfig(loss_type=loss_type, kl_coef=kl_coef, micro_batch=3)
    before = {
        t: (response_logprob(model, *GOOD[t]), response_logprob(model, *BAD[t])) for t in GOOD
    }
    for _ in range(15):
        batch = with_rollout_logprobs(model, bandit_batch())
        metrics = policy_update(
            model=model, ref_model=ref, optimizer=optimizer, samples=batch,
            logprob_fn=toy_logprob_fn, config=config, curation=EVERY_STEP,
        )  # fmt: skip
        assert metrics.optimizer_steps == 1 and metrics.skipped_groups == 0
    for task, (good_before, bad_before) in before.items():
        assert response_logprob(model, *GOOD[task]) > good_before + 1.0
        assert response_logprob(model, *BAD[task]) < bad_before - 1.0
    if kl_coef:
        assert metrics.kl > 0


@pytest.mark.parametrize("aggregation", ["trajectory", "token"])
def test_a_long_failed_episode_does_not_outweigh_a_short_success(aggregation: str) -> None:
    """A 1-step success and a 3-step failure that said the same thing: under trajectory
    aggregation their advantages (+a, -a) cancel and the response keeps its probability;
    under token aggregation the failure's 3 steps win and push it down."""
    model = tiny_lm(seed=3)
    batch = [sample(1, 7, "ab", "cd", 1.0, trajectory=10)] + [
        sample(step, 7, "ab", "cd", 0.0, trajectory=20) for step in (2, 3, 4)
    ]
    before = response_logprob(model, "ab", "cd")
    config = TrainerConfig(kl_coef=0.0, loss_aggregation=aggregation)
    policy_update(
        model=model, ref_model=None, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        samples=with_rollout_logprobs(model, batch), logprob_fn=toy_logprob_fn, config=config,
        curation=EVERY_STEP,
    )  # fmt: skip
    after = response_logprob(model, "ab", "cd")
    if aggregation == "trajectory":
        assert after == pytest.approx(before, abs=1e-5)
    else:
        assert after < before - 0.05


def test_kl_coef_zero_needs_no_ref_model_but_positive_kl_does() -> None:
    model = tiny_lm()
    before = [p.detach().clone() for p in model.parameters()]
    metrics = policy_update(
        model=model, ref_model=None, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        samples=bandit_batch(), logprob_fn=toy_logprob_fn, config=TrainerConfig(kl_coef=0.0),
        curation=RUN,
    )  # fmt: skip
    assert metrics.optimizer_steps == 1 and metrics.kl == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match=r"kl_coef=0.1 needs a reference model.*set kl_coef=0"):
        policy_update(
            model=model, ref_model=None, optimizer=torch.optim.AdamW(model.parameters()),
            samples=bandit_batch(), logprob_fn=toy_logprob_fn, config=TrainerConfig(kl_coef=0.1),
            curation=RUN,
        )  # fmt: skip


def test_gradient_accumulation_matches_one_big_batch() -> None:
    """Token-mean over the whole batch, whatever the micro-batches (SGD exposes the grad)."""
    base = tiny_lm(seed=1)
    batch = with_rollout_logprobs(base, bandit_batch())
    # Make the rollout policy differ so the IS weights are not all 1.
    batch = [
        dataclasses.replace(
            s, rollout_logprobs=[lp + 0.3 * (k % 2) for k, lp in enumerate(s.rollout_logprobs)]
        )
        for s in batch
    ]
    ref = tiny_lm(seed=2).requires_grad_(False)
    lengths = [len(s.messages[-1]["content"]) + len(s.response_text) for s in batch]
    results = []
    # By samples (1, 3, 8 a micro-batch), then by a token budget (micro-batches of 1 to 3).
    for micro_batch, budget in ((1, 100), (3, 100), (8, 100), (8, 12)):
        model = copy.deepcopy(base)
        config = TrainerConfig(micro_batch=micro_batch, micro_batch_tokens=budget, kl_coef=0.1,
                               grad_clip=1e6)  # fmt: skip
        metrics = policy_update(
            model=model, ref_model=ref, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            samples=batch, logprob_fn=toy_logprob_fn, config=config, curation=RUN,
            sample_tokens=lengths,
        )  # fmt: skip
        results.append((torch.cat([p.detach().flatten() for p in model.parameters()]), metrics))
    (p1, m1), (p3, _), (p8, m8), (p_tokens, m_tokens) = results
    assert torch.allclose(p1, p8, atol=1e-5) and torch.allclose(p3, p8, atol=1e-5)
    assert torch.allclose(p_tokens, p8, atol=1e-5)
    assert m_tokens.loss == pytest.approx(m8.loss, abs=1e-5)
    assert m1.loss == pytest.approx(m8.loss, abs=1e-5)
    assert m1.kl == pytest.approx(m8.kl, abs=1e-6) and m8.kl > 0
    assert m8.is_weight_min < 1.0 and m8.is_weight_max == pytest.approx(1.0)
    assert not torch.equal(p8, torch.cat([p.flatten() for p in base.parameters()]))


def test_the_update_steps_at_the_optimizers_learning_rate() -> None:
    """SGD moves the weights by lr * grad: the same batch at half the rate the optimizer was
    given (the trainer's schedule sets it) moves them half as far, and the metrics record the
    rate used."""
    base = tiny_lm(seed=1)
    batch = with_rollout_logprobs(base, bandit_batch())
    moves = {}
    for lr in (0.2, 0.1):
        model = copy.deepcopy(base)
        metrics = policy_update(
            model=model, ref_model=None, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            samples=batch, logprob_fn=toy_logprob_fn,
            config=TrainerConfig(kl_coef=0.0, grad_clip=1e6), curation=RUN,
        )  # fmt: skip
        assert metrics.lr == pytest.approx(lr)
        moves[lr] = torch.cat(
            [
                (p - q).detach().flatten()
                for p, q in zip(model.parameters(), base.parameters(), strict=True)
            ]
        )
    assert moves[0.1].abs().sum() > 0
    assert torch.allclose(moves[0.2], 2 * moves[0.1], atol=1e-6)


def test_entropy_filter_groups_and_per_step_decisions() -> None:
    samples = [
        # task 1: two-step trajectory 10 (reward 1) vs trajectory 11 (reward 0)
        sample(1, 1, "ab", "cd", 1.0, trajectory=10, entropy=0.9, version=3),
        sample(2, 1, "abcd", "e", 1.0, trajectory=10, entropy=0.1, version=3),
        sample(3, 1, "ab", "ff", 0.0, trajectory=11, entropy=0.5, version=2),
        # task 2: all failed -> skipped group
        sample(4, 2, "ba", "g", 0.0, entropy=2.0, version=1),
        sample(5, 2, "ba", "h", 0.0, entropy=2.0, version=3),
        # task 3: a single trajectory -> skipped group
        sample(6, 3, "ca", "i", 1.0, entropy=3.0, version=3),
    ]
    model = tiny_lm()
    config, curation = TrainerConfig(kl_coef=0.0), CurationConfig(entropy_top_q=0.6)
    metrics = policy_update(
        model=model, ref_model=None, optimizer=torch.optim.AdamW(model.parameters()),
        samples=samples, logprob_fn=toy_logprob_fn, config=config, curation=curation,
        policy_version=3,
    )  # fmt: skip
    # Ranked: steps 1, 2, 3 of task 1 (others skipped); ceil(0.6 * 3) = 2 keep -> 1 and 3.
    assert metrics.step_entropy_kept == {1: True, 2: False, 3: True}
    assert metrics.step_kept == {1: True, 2: False, 3: True, 4: False, 5: False, 6: False}
    assert metrics.kept_step_fraction == pytest.approx(2 / 6)
    assert (metrics.n_groups, metrics.skipped_groups) == (3, 2)
    # Trajectory rewards [1, 0] -> +-0.5 / (sqrt(0.5) + eps), shared by both steps of 10.
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert metrics.step_advantage[1] == pytest.approx(a) and metrics.step_advantage[
        2
    ] == pytest.approx(a)
    assert metrics.step_advantage[3] == pytest.approx(-a) and metrics.step_advantage[4] == 0.0
    assert metrics.staleness == {0: 4, 1: 1, 2: 1}
    assert metrics.as_json()["staleness"] == {"0": 4, "1": 1, "2": 1}
    # Empty rollout log-probs on online steps are reported, with IS weight 1.
    assert metrics.is_misaligned_steps == 2 and metrics.step_is_weight == {1: 1.0, 3: 1.0}
    assert metrics.n_tokens == 4 and metrics.optimizer_steps == 1 and metrics.mean_entropy > 0


@pytest.mark.parametrize("recenter", [True, False])
def test_entropy_filter_that_drops_confident_successes_leaves_no_net_push(recenter: bool) -> None:
    """Two confident successes and two unsure failures; q = 0.75 drops one success. With
    re-centring the kept advantages still sum to 0 (and success > failure); without, the
    update pushes down on balance, as DART's filter does."""
    samples = [
        sample(1, 1, "ab", "c", 1.0, entropy=0.1),
        sample(2, 1, "ab", "c", 1.0, entropy=0.2),
        sample(3, 1, "ab", "d", 0.0, entropy=0.9),
        sample(4, 1, "ab", "e", 0.0, entropy=0.8),
    ]
    curation = CurationConfig(entropy_top_q=0.75, entropy_recenter=recenter)
    plan = plan_update(samples, TrainerConfig(), curation)
    assert plan.pg_keep == [False, True, True, True]
    kept = [a for a, k in zip(plan.advantage, plan.pg_keep, strict=True) if k]
    if recenter:
        assert sum(kept) == pytest.approx(0.0, abs=1e-6)
        assert kept[0] > 0 > kept[1] and kept[1] == pytest.approx(kept[2])
    else:
        assert sum(kept) < -0.5


def test_nothing_to_train_takes_no_optimizer_step() -> None:
    samples = [
        sample(1, 1, "ab", "c", 1.0),
        sample(2, 1, "ab", "d", 1.0),
        sample(3, 2, "ba", "e", 0.0),
    ]
    model = tiny_lm()
    before = [p.detach().clone() for p in model.parameters()]
    metrics = policy_update(
        model=model, ref_model=None, optimizer=torch.optim.AdamW(model.parameters()),
        samples=samples, logprob_fn=toy_logprob_fn, config=TrainerConfig(kl_coef=0.0),
        curation=RUN,
    )  # fmt: skip
    assert metrics.optimizer_steps == 0 and metrics.skipped_groups == 2
    assert metrics.step_kept == {1: False, 2: False, 3: False}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_experience_pool_demo_is_learned_in_an_all_failed_group() -> None:
    """Every online rollout failed; a pool success joins the group and BC pulls it up."""
    model = tiny_lm(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    demo = sample(9, 1, "ab", "kkl", 1.0, demo=True, entropy=0.0)
    online = [sample(i, 1, "ab", r, 0.0) for i, r in ((1, "mm"), (2, "n"), (3, "mm"))]
    config = TrainerConfig(kl_coef=0.0, bc_weight=0.5, micro_batch=2)
    curation = CurationConfig(entropy_top_q=0.5)
    demo_before = response_logprob(model, "ab", "kkl")
    for _ in range(10):
        batch = [*with_rollout_logprobs(model, online), demo]
        metrics = policy_update(
            model=model, ref_model=None, optimizer=optimizer, samples=batch,
            logprob_fn=toy_logprob_fn, config=config, curation=curation,
        )  # fmt: skip
    # The demo is never dropped by the entropy filter and has the positive advantage.
    assert metrics.step_kept[9] and metrics.step_advantage[9] > 0 > metrics.step_advantage[1]
    assert metrics.n_demo_steps == 1 and metrics.bc_loss > 0 and metrics.is_misaligned_steps == 0
    assert response_logprob(model, "ab", "kkl") > demo_before + 1.0


def test_several_epochs_and_mini_batches_clip_the_drifting_ratio() -> None:
    model = tiny_lm()
    config = TrainerConfig(kl_coef=0.0, ppo_epochs=3, mini_batches=2)
    metrics = policy_update(
        model=model, ref_model=None, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-2),
        samples=with_rollout_logprobs(model, bandit_batch()), logprob_fn=toy_logprob_fn,
        config=config, curation=EVERY_STEP,
    )  # fmt: skip
    assert metrics.optimizer_steps == 6
    assert 0 < metrics.clip_fraction < 1  # pi_theta moved away from pi_old after the first step


def test_plan_rejects_a_trajectory_with_two_rewards() -> None:
    samples = [
        sample(1, 1, "ab", "c", 1.0, trajectory=5),
        sample(2, 1, "ab", "d", 0.0, trajectory=5),
    ]
    with pytest.raises(ValueError, match="all steps of a trajectory share its reward"):
        plan_update(samples, TrainerConfig(), RUN)


def test_a_pool_demo_in_two_groups_of_one_batch_counts_in_each() -> None:
    """The experience pool can put the same demo into two all-failed groups of a task; both
    can be ready together. It is a member of each group (it used to stop the trainer)."""
    samples = [
        sample(1, 1, "ab", "d", 0.0, trajectory=11),
        sample(2, 1, "ab", "e", 0.0, trajectory=12),
        sample(9, 1, "ab", "c", 1.0, trajectory=99, demo=True),
        sample(3, 2, "ab", "f", 0.0, trajectory=13),
        sample(4, 2, "ab", "g", 0.0, trajectory=14),
        sample(9, 2, "ab", "c", 1.0, trajectory=99, demo=True),
    ]
    plan = plan_update(samples, TrainerConfig(), EVERY_STEP)
    assert plan.skipped_groups == 0 and plan.n_groups == 2
    assert plan.advantage[2] > 0 and plan.advantage[5] > 0
    assert plan.advantage[2] == pytest.approx(plan.advantage[5])
    model = tiny_lm()
    before = response_logprob(model, "ab", "c")
    policy_update(
        model=model, ref_model=None, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        samples=samples, logprob_fn=toy_logprob_fn, config=TrainerConfig(kl_coef=0.0),
        curation=RUN,
    )  # fmt: skip
    assert response_logprob(model, "ab", "c") > before


@pytest.mark.parametrize(
    ("settings", "kwargs", "message"),
    [
        (TrainerConfig, {"loss_type": "grpo"}, "loss_type: must be one of ppo, gspo, got 'grpo'"),
        (TrainerConfig, {"loss_aggregation": "seq"},
         "loss_aggregation: must be one of trajectory, token, got 'seq'"),
        (TrainerConfig, {"clip_low": 0.0}, r"clip_low: must be in \(0, 1\)"),
        (TrainerConfig, {"clip_high": -0.1}, "clip_high: must be > 0"),
        (TrainerConfig, {"gspo_clip_high": 0.0}, "gspo_clip_high: must be > 0"),
        (CurationConfig, {"entropy_top_q": 0.0}, r"entropy_top_q: must be in \(0, 1\]"),
        (CurationConfig, {"entropy_top_q": 1.5}, r"entropy_top_q: must be in \(0, 1\]"),
        (CurationConfig, {"is_cap": 0.0}, "is_cap: must be > 0"),
        (TrainerConfig, {"kl_coef": -1.0}, "kl_coef: must be >= 0"),
        (TrainerConfig, {"micro_batch": 0}, "micro_batch: must be >= 1"),
        (TrainerConfig, {"micro_batch_tokens": -1}, "micro_batch_tokens: must be >= 0"),
        (TrainerConfig, {"ppo_epochs": 0}, "ppo_epochs: must be >= 1"),
        (TrainerConfig, {"grad_clip": 0.0}, "grad_clip: must be > 0"),
    ],
)  # fmt: skip
def test_the_update_settings_refuse_what_it_cannot_compute_with(
    settings: type, kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{message}"):
        settings(**kwargs)


def test_train_sample_rejects_missing_reward() -> None:
    with pytest.raises(ValueError, match="step 7: reward must be a finite number"):
        sample(7, 1, "ab", "c", float("nan"))


def test_the_logprob_gap_is_numerics_when_weights_match_and_large_when_the_server_was_stale() -> (
    None
):
    """Fresh steps whose rollout log-probs came from the weights being trained: the gap is
    numerical noise. The same steps sampled from older weights by a server that claimed the
    new version (the silent-staleness fault): the gap jumps, though the IS weights hide it."""
    model, stale = tiny_lm(seed=0), tiny_lm(seed=1)
    config = TrainerConfig(micro_batch=3, kl_coef=0.0)

    def gap_of(server: torch.nn.Module) -> tuple[float, float, int]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # measure only: no weight change
        metrics = policy_update(
            model=model, ref_model=None, optimizer=optimizer,
            samples=with_rollout_logprobs(server, bandit_batch()),
            logprob_fn=toy_logprob_fn, config=config, curation=EVERY_STEP, policy_version=0,
        )  # fmt: skip
        return metrics.logprob_gap_mean, metrics.logprob_gap_p99, metrics.logprob_gap_tokens

    mean, p99, tokens = gap_of(model)
    assert tokens > 0 and mean < 1e-4 and p99 < 1e-3
    stale_mean, stale_p99, _ = gap_of(stale)
    assert stale_mean > 0.05 and stale_mean > 100 * mean and stale_p99 > stale_mean
    # Steps from an older version are staleness, which IS corrects: not counted in the gap.
    older = [dataclasses.replace(s, policy_version=-1) for s in bandit_batch()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = policy_update(
        model=model, ref_model=None, optimizer=optimizer,
        samples=with_rollout_logprobs(stale, older), logprob_fn=toy_logprob_fn,
        config=config, curation=EVERY_STEP, policy_version=0,
    )  # fmt: skip
    assert metrics.logprob_gap_tokens == 0


def test_one_epoch_one_step_skips_the_pi_old_pass_and_takes_the_same_step() -> None:
    """With one epoch in one optimizer step the gradient pass's own log-probs are pi_old's:
    the update skips the separate pass and still takes exactly the step that pass gives."""
    calls: list[str] = []

    def counting_logprob_fn(model, samples):
        calls.append("ref" if model is ref else "policy")
        return toy_logprob_fn(model, samples)

    start = tiny_lm()
    ref = copy.deepcopy(start).requires_grad_(False)
    rollout = with_rollout_logprobs(tiny_lm(seed=1), bandit_batch())  # an older policy's
    with_ids = [dataclasses.replace(s, response_token_ids=encode(s.response_text)) for s in rollout]
    config = TrainerConfig(kl_coef=0.05, micro_batch=3)
    results = {}
    for name, batch in (("separate", rollout), ("fused", with_ids)):
        model = copy.deepcopy(start)
        calls.clear()
        metrics = policy_update(
            model=model, ref_model=ref, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
            samples=batch, logprob_fn=counting_logprob_fn, config=config, curation=EVERY_STEP,
        )  # fmt: skip
        results[name] = (model, metrics, calls.count("policy"), calls.count("ref"))
    (separate, m_sep, policy_sep, ref_sep), (fused, m_fused, policy_fused, ref_fused) = (
        results["separate"], results["fused"],
    )  # fmt: skip
    micro_batches = math.ceil(len(rollout) / config.micro_batch)
    assert (m_sep.passes, policy_sep, ref_sep) == ("old+ref+grad", 2 * micro_batches, micro_batches)
    assert (m_fused.passes, policy_fused, ref_fused) == ("ref+grad", micro_batches, micro_batches)
    assert m_fused.old_pass_s == 0.0 < m_sep.old_pass_s
    for a, b in zip(separate.parameters(), fused.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    for field in ("loss", "pg_loss", "kl", "is_weight_mean", "is_weight_min", "mean_entropy",
                  "logprob_gap_mean", "grad_norm"):  # fmt: skip
        assert getattr(m_fused, field) == pytest.approx(getattr(m_sep, field), rel=1e-5, abs=1e-7)
    assert m_fused.is_weight_min < 1.0  # the rollout was another policy's: IS weights acted
    assert m_fused.n_tokens == m_sep.n_tokens > 0
    assert m_fused.step_is_weight == pytest.approx(m_sep.step_is_weight)


def test_a_stop_between_micro_batches_leaves_the_weights_as_they_were() -> None:
    from training.update import UpdateInterrupted

    model = tiny_lm()
    before = [p.detach().clone() for p in model.parameters()]
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1  # after the first micro-batch

    with pytest.raises(UpdateInterrupted, match="no optimizer step taken"):
        policy_update(
            model=model, ref_model=None, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
            samples=bandit_batch(), logprob_fn=toy_logprob_fn,
            config=TrainerConfig(kl_coef=0.0, micro_batch=2), curation=EVERY_STEP, stop=stop,
        )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_encode_ahead_gets_the_first_pass_order_of_this_replica() -> None:
    """The prompts encoded ahead are the ones the first pass asks for, in its order, in the
    fused and the separate pi_old pass; a replica is told its own share only."""
    from training.replicas import Replicas
    from training.update import _first_pass

    start = tiny_lm()
    rollout = with_rollout_logprobs(tiny_lm(seed=1), bandit_batch())
    with_ids = [dataclasses.replace(s, response_token_ids=encode(s.response_text)) for s in rollout]
    config = TrainerConfig(kl_coef=0.0, micro_batch=3)
    asked: list[int] = []
    ahead: list[list[int]] = []

    def recording_logprob_fn(model, samples):
        asked.extend(s.step_id for s in samples)
        return toy_logprob_fn(model, samples)

    for batch in (rollout, with_ids):  # the separate pi_old pass, then the fused one
        asked.clear()
        ahead.clear()
        model = copy.deepcopy(start)
        policy_update(
            model=model, ref_model=None, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            samples=batch, logprob_fn=recording_logprob_fn, config=config, curation=EVERY_STEP,
            encode_ahead=lambda steps: ahead.append([s.step_id for s in steps]),
        )  # fmt: skip
        assert len(ahead) == 1 and ahead[0] == asked[: len(ahead[0])] and ahead[0]
        assert sorted(ahead[0]) == sorted(s.step_id for s in batch)
    # Two replicas: each is told the micro-batches dealt to it, together every step once.
    order = list(range(len(rollout)))
    shares = [_first_pass(order, None, config, Replicas(rank=r, world=2)) for r in (0, 1)]
    assert shares[0] == [0, 1, 2, 6, 7] and shares[1] == [3, 4, 5]
    assert sorted(shares[0] + shares[1]) == order
