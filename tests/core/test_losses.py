"""Loss functions against values computed by hand in the test (not by the code under test)."""

from __future__ import annotations

import math

import pytest
import torch

from core.losses import (
    bc_loss,
    broadcast_to_steps,
    group_advantages,
    gspo_loss,
    high_entropy_mask,
    kl_low_variance,
    policy_loss,
    ppo_clip_loss,
    recenter_kept_advantages,
    trajectory_step_weights,
    truncated_is_weights,
)

EPS = 1e-6


def close(actual: torch.Tensor | float, expected: float | list, tol: float = 1e-5) -> bool:
    actual_t = torch.as_tensor(actual, dtype=torch.float64)
    return torch.allclose(actual_t, torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# --- group advantages ----------------------------------------------------------------------


def test_group_advantages_sample_std_and_skipped_groups() -> None:
    # group 7: [1, 0]      mean 0.5, sample std sqrt(0.5)       -> +-0.5 / sqrt(0.5)
    # group 3: [1, 1]      zero spread                          -> skipped
    # group 9: [3]         one trajectory                       -> skipped
    # group 5: [0, 0, 3]   mean 1, sample var (1+1+4)/2 = 3     -> (-1, -1, 2) / sqrt(3)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 1.0, 0.0, 3.0])
    groups = torch.tensor([7, 5, 3, 7, 9, 3, 5, 5])
    adv, keep, skipped = group_advantages(rewards, groups, eps=EPS)
    s2, s3 = math.sqrt(0.5), math.sqrt(3.0)
    expected = [
        0.5 / (s2 + EPS),
        -1 / (s3 + EPS),
        0,
        -0.5 / (s2 + EPS),
        0,
        0,
        -1 / (s3 + EPS),
        2 / (s3 + EPS),
    ]
    assert close(adv, expected)
    assert keep.tolist() == [True, True, False, True, False, False, True, True]
    assert skipped == 2


def test_group_advantages_all_equal_and_empty() -> None:
    adv, keep, skipped = group_advantages(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1, 1, 1]))
    assert adv.tolist() == [0.0, 0.0, 0.0] and not keep.any() and skipped == 1
    adv, keep, skipped = group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert adv.numel() == 0 and keep.numel() == 0 and skipped == 0


def test_group_advantages_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="same length"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_broadcast_to_steps_gives_each_step_its_trajectory_value() -> None:
    traj_adv = torch.tensor([0.5, -1.0])
    assert broadcast_to_steps(traj_adv, torch.tensor([0, 0, 1, 0, 1])).tolist() == [
        0.5, 0.5, -1.0, 0.5, -1.0,
    ]  # fmt: skip


# --- high-entropy selection ----------------------------------------------------------------


def test_high_entropy_mask_keeps_top_q_with_ceil_and_stable_ties() -> None:
    ent = torch.tensor([0.5, 2.0, 1.0, 1.0, 0.1])
    # q=0.8: ceil(4.0) = 4 -> drop the lowest (0.1)
    assert high_entropy_mask(ent, q=0.8).tolist() == [True, True, True, True, False]
    # q=0.5: ceil(2.5) = 3 -> 2.0 and both 1.0s
    assert high_entropy_mask(ent, q=0.5).tolist() == [False, True, True, True, False]
    # q=0.4: ceil(2.0) = 2 -> 2.0 and the earlier of the tied 1.0s
    assert high_entropy_mask(ent, q=0.4).tolist() == [False, True, True, False, False]
    # q=0.01: ceil(0.05) = 1 -> at least one step
    assert high_entropy_mask(ent, q=0.01).tolist() == [False, True, False, False, False]
    assert high_entropy_mask(ent, q=1.0).all()


def test_high_entropy_mask_float_product_does_not_round_up() -> None:
    # 0.7 * 10 == 7.000000000000001 in floating point; 7 steps are kept, not 8.
    ent = torch.arange(10, dtype=torch.float32)
    keep = high_entropy_mask(ent, q=0.7)
    assert keep.sum() == 7 and keep[3:].all()


def test_high_entropy_mask_edge_cases() -> None:
    assert high_entropy_mask(torch.zeros(0), q=0.8).numel() == 0
    with pytest.raises(ValueError, match=r"q must be in \(0, 1\]"):
        high_entropy_mask(torch.ones(3), q=0.0)


# --- truncated importance sampling ---------------------------------------------------------


def test_recenter_kept_advantages_by_hand() -> None:
    # group 1: +1, +1, -1, -1, the filter dropped one success -> kept +1, -1, -1 (mean -1/3)
    # group 2: kept +2 (weight 0.5) and -1 (weight 1): weighted mean (1 - 1) / 1.5 = 0
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -1.0])
    groups = torch.tensor([1, 1, 1, 1, 2, 2])
    keep = torch.tensor([True, False, True, True, True, True])
    weights = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 1.0])
    out = recenter_kept_advantages(adv, groups, keep, weights)
    assert close(out, [4 / 3, 1.0, -2 / 3, -2 / 3, 2.0, -1.0])
    kept_sum = float((out[:4] * keep[:4]).sum())
    assert kept_sum == pytest.approx(0.0, abs=1e-6)
    # nothing kept: unchanged
    none = torch.zeros(6, dtype=torch.bool)
    assert close(recenter_kept_advantages(adv, groups, none, weights), adv.tolist())


def test_truncated_is_weights_by_hand() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    # exp(0.5) = 1.6487 -> capped at 1; exp(-1) = 0.36788; masked -> 0
    assert close(truncated_is_weights(old, rollout, mask, cap=1.0), [[1.0, math.exp(-1), 0.0]])
    assert close(
        truncated_is_weights(old, rollout, mask, cap=2.0), [[math.exp(0.5), math.exp(-1), 0.0]]
    )


def test_truncated_is_weights_carry_no_gradient_and_survive_huge_ratios() -> None:
    old = torch.tensor([[50.0, -1.0]], requires_grad=True)
    w = truncated_is_weights(old, torch.tensor([[-50.0, -1.0]]), torch.ones(1, 2), cap=1.0)
    assert not w.requires_grad
    assert w.tolist() == [[1.0, 1.0]]


# --- PPO -----------------------------------------------------------------------------------

# Ratios chosen by hand; old log-probs are 0, so logprobs = log(ratio).
# seq 0, A = +1: r = 1.5 (clipped to 1.28, selected), 0.9, 1.1
# seq 1, A = -2: r = 0.5 (clipped to 0.8 -> -1.6 < -1.0, selected), 1.0, [1.3 masked]
RATIOS = [[1.5, 0.9, 1.1], [0.5, 1.0, 1.3]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -2.0])


def _ppo_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = torch.log(torch.tensor(RATIOS)).requires_grad_()
    return logprobs, torch.zeros(2, 3)


def test_ppo_clip_loss_by_hand() -> None:
    logprobs, old = _ppo_inputs()
    loss, clip_fraction = ppo_clip_loss(logprobs, old, ADV, MASK, clip_low=0.2, clip_high=0.28)
    # token losses: -1.28, -0.9, -1.1, +1.6, +2.0 -> sum 0.32 over 5 tokens
    assert close(loss, 0.32 / 5)
    assert clip_fraction == pytest.approx(2 / 5)
    loss.backward()
    # d(-r*A)/d logp = -A * r / N on unclipped tokens, 0 on clipped and masked ones
    expected_grad = [[0.0, -0.9 / 5, -1.1 / 5], [0.0, 2.0 * 1.0 / 5, 0.0]]
    assert close(logprobs.grad, expected_grad)


def test_ppo_clip_loss_with_is_weights_and_normalizer() -> None:
    logprobs, old = _ppo_inputs()
    w = torch.tensor([[1.0, 0.5, 1.0], [0.25, 1.0, 0.0]])
    loss, _ = ppo_clip_loss(logprobs, old, ADV, MASK, is_weights=w)
    # -1.28 - 0.45 - 1.1 + 0.4 + 2.0 = -0.43
    assert close(loss, -0.43 / 5)
    loss, _ = ppo_clip_loss(logprobs, old, ADV, MASK, is_weights=w, normalizer=10)
    assert close(loss, -0.43 / 10)


def test_trajectory_step_weights_count_each_trajectory_once() -> None:
    # trajectory 4: two kept steps; trajectory 9: one kept step and one that does not train
    weights = trajectory_step_weights(
        torch.tensor([4, 9, 4, 9]), torch.tensor([True, True, True, False])
    )
    assert close(weights, [0.5, 1.0, 0.5, 0.0])
    assert close(weights.sum(), 2.0)  # the number of trajectories
    # Each trajectory's weights add up to 1: the pg loss is a mean over trajectories.
    assert close(weights[0] + weights[2], 1.0) and close(weights[1], 1.0)
    with pytest.raises(ValueError, match="same length"):
        trajectory_step_weights(torch.tensor([1, 2]), torch.tensor([True]))


def test_ppo_clip_loss_with_sample_weights() -> None:
    logprobs, old = _ppo_inputs()
    loss, _ = ppo_clip_loss(
        logprobs, old, ADV, MASK, sample_weights=torch.tensor([0.5, 0.25]), normalizer=2
    )
    # row 0 tokens -1.28 - 0.9 - 1.1 = -3.28 (x0.5), row 1: 1.6 + 2.0 = 3.6 (x0.25)
    assert close(loss, (-3.28 * 0.5 + 3.6 * 0.25) / 2)
    with pytest.raises(ValueError, match=r"sample_weights must be \[B\]=\[2\]"):
        ppo_clip_loss(logprobs, old, ADV, MASK, sample_weights=torch.ones(3))


def test_ppo_ratio_below_range_with_positive_advantage_is_not_clipped() -> None:
    # r = 0.7, A = +1: min(0.7, 0.8) = 0.7 -> unclipped term, gradient flows.
    logprobs = torch.log(torch.tensor([[0.7]])).requires_grad_()
    loss, clip_fraction = ppo_clip_loss(
        logprobs, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1)
    )
    assert close(loss, -0.7) and clip_fraction == 0.0
    loss.backward()
    assert close(logprobs.grad, [[-0.7]])


def test_ppo_all_masked_is_zero_and_backpropagates() -> None:
    logprobs, old = _ppo_inputs()
    loss, clip_fraction = ppo_clip_loss(logprobs, old, ADV, torch.zeros(2, 3))
    assert loss.item() == 0.0 and clip_fraction == 0.0
    loss.backward()
    assert logprobs.grad is not None and not logprobs.grad.any()


def test_ppo_rejects_bad_shapes() -> None:
    logprobs, old = _ppo_inputs()
    with pytest.raises(ValueError, match=r"advantages must be \[B\]=\[2\]"):
        ppo_clip_loss(logprobs, old, torch.ones(3), MASK)
    with pytest.raises(ValueError, match="shapes must match"):
        ppo_clip_loss(logprobs, old[:, :2], ADV, MASK)


# --- GSPO ----------------------------------------------------------------------------------


def test_gspo_loss_by_hand() -> None:
    log_ratio = torch.tensor(
        [
            [0.001, 0.0, -0.0004],  # mean 0.0002, A=+1: s inside [0.9997, 1.0004]
            [0.002, 0.0, 9.9],  # mean 0.001 (9.9 masked), A=-2: s*A=-2.002 < -2.0008, unclipped
            [0.002, 0.002, 0.0],  # mean 0.002 (last masked), A=+1: clipped to 1.0004
            [0.5, 0.5, 0.5],  # fully masked: not counted
        ]
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [0, 0, 0]])
    adv = torch.tensor([1.0, -2.0, 1.0, 5.0])
    logprobs = log_ratio.clone().requires_grad_()
    loss, clip_fraction = gspo_loss(
        logprobs, torch.zeros(4, 3), adv, mask, clip_low=3e-4, clip_high=4e-4
    )
    s0, s1 = math.exp(0.0002), math.exp(0.001)
    expected = (-s0 + 2 * s1 - 1.0004) / 3
    assert close(loss, expected, tol=1e-6)
    assert clip_fraction == pytest.approx(1 / 3)
    loss.backward()
    # seq 0: d(-s*A)/d logp_t = -A * s / len / n_seq; seq 2 clipped -> 0
    assert close(logprobs.grad[0], [-s0 / 3 / 3] * 3, tol=1e-6)
    assert close(logprobs.grad[1], [2 * s1 / 2 / 3, 2 * s1 / 2 / 3, 0.0], tol=1e-6)
    assert not logprobs.grad[2:].any()

    w = torch.tensor([[1.0, 0.5, 0.6], [0.2, 0.4, 7.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss_w, _ = gspo_loss(logprobs, torch.zeros(4, 3), adv, mask, is_weights=w)
    # sequence weights: mean of unmasked token weights -> 0.7, 0.3, 1.0
    assert close(loss_w, (-s0 * 0.7 + 2 * s1 * 0.3 - 1.0004) / 3, tol=1e-6)


# --- KL and BC -----------------------------------------------------------------------------


def test_kl_low_variance_by_hand() -> None:
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # d = ref - logp = -0.5, 0 -> k3 = exp(-0.5) + 0.5 - 1, 0
    expected = (math.exp(-0.5) + 0.5 - 1) / 2
    kl = kl_low_variance(logprobs, ref, mask)
    assert close(kl, expected)
    kl.backward()
    # d k3 / d logp = 1 - exp(ref - logp)
    assert close(logprobs.grad, [[(1 - math.exp(-0.5)) / 2, 0.0, 0.0]])
    assert kl_low_variance(logprobs, logprobs.detach(), torch.ones(1, 3)).item() == 0.0
    assert kl_low_variance(logprobs, ref, torch.zeros(1, 3)).item() == 0.0


def test_kl_of_a_token_the_policy_has_moved_far_from_is_capped() -> None:
    """A stale token the reference likes 12 nats more than the policy: uncapped k3 is
    exp(12) - 13 ~ 162,741; capped at 10, it adds no gradient, and the other token keeps
    its own term and gradient."""
    logprobs = torch.tensor([[-13.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    kl = kl_low_variance(logprobs, ref, torch.ones(1, 2))
    assert close(kl, (10.0 + math.exp(-0.5) + 0.5 - 1) / 2)
    kl.backward()
    assert close(logprobs.grad, [[0.0, (1 - math.exp(-0.5)) / 2]])
    uncapped = kl_low_variance(logprobs, ref, torch.ones(1, 2), max_per_token=float("inf"))
    assert uncapped.item() > 80_000


def test_bc_loss_by_hand() -> None:
    logprobs = torch.tensor([[-1.0, -3.0, -7.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert close(bc_loss(logprobs, mask), 2.0)
    assert close(bc_loss(logprobs, mask, normalizer=4), 1.0)
    assert bc_loss(logprobs, torch.zeros(2, 3)).item() == 0.0


# --- combined ------------------------------------------------------------------------------


def test_policy_loss_combines_terms() -> None:
    logprobs, old = _ppo_inputs()
    ref = logprobs.detach() - 0.5  # d = -0.5 everywhere -> k3 = exp(-0.5) - 0.5
    bc_mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    out = policy_loss(
        logprobs=logprobs, old_logprobs=old, advantages=ADV, pg_mask=MASK,
        ref_logprobs=ref, kl_coef=0.1, bc_mask=bc_mask, bc_weight=0.5,
    )  # fmt: skip
    pg = 0.32 / 5
    kl = math.exp(-0.5) - 0.5
    bc = -(math.log(0.5) + math.log(1.0)) / 2
    assert close(out.pg_loss, pg) and close(out.kl, kl) and close(out.bc_loss, bc)
    assert close(out.loss, pg + 0.1 * kl + 0.5 * bc)
    assert out.clip_fraction == pytest.approx(0.4)
    assert (out.n_pg_tokens, out.n_bc_tokens) == (5, 2)


def test_policy_loss_gspo_and_errors() -> None:
    logprobs, old = _ppo_inputs()
    out = policy_loss(
        logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=ADV, pg_mask=MASK,
        loss_type="gspo", clip_low=3e-4, clip_high=4e-4,
    )  # fmt: skip
    # ratio 1 everywhere: mean over sequences of -A = (-1 + 2) / 2
    assert close(out.loss, 0.5) and out.kl.item() == 0.0 and out.bc_loss.item() == 0.0
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        policy_loss(logprobs=logprobs, old_logprobs=old, advantages=ADV, pg_mask=MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match="loss_type must be 'ppo' or 'gspo'"):
        policy_loss(
            logprobs=logprobs, old_logprobs=old, advantages=ADV, pg_mask=MASK, loss_type="grpo"
        )
