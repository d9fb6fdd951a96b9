"""Loss functions of Dartboard's step-level GRPO trainer (pure PyTorch, no state).

Shapes: B = sequences (steps) in a batch, T = padded token positions, N = steps, M = trajectories.
`mask[B, T]` marks the response tokens (1/True) that a loss sees; padding and prompt are 0.
Every aggregate over masked positions returns 0 (still attached to the graph, so `.backward()`
works) when nothing is unmasked.

Gradient accumulation: the token/sequence-mean losses take an optional `normalizer`. By default
a loss divides by its own count of unmasked tokens (sequences); a caller that splits one
mini-batch into micro-batches passes the mini-batch's count, so the micro-batch losses add up
exactly to the mini-batch mean.

Run the tests: `.venv/bin/pytest -p no:django tests/core/test_losses.py -q`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Rewards closer than this count as equal (a group with no reward spread has no signal).
_ZERO_SPREAD = 1e-8


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        listed = ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"tensor shapes must match, got {listed}")


def _masked_sum_over(values: Tensor, mask: Tensor, normalizer: float | None) -> Tensor:
    """sum(values * mask) / (normalizer or mask.sum()); 0 (with graph) when the divisor is 0."""
    total = (values * mask).sum()
    divisor = float(mask.sum().item()) if normalizer is None else float(normalizer)
    if divisor <= 0:
        return total * 0.0
    return total / divisor


# --- advantages and step selection -------------------------------------------------------


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6
) -> tuple[Tensor, Tensor, int]:
    """GRPO group-normalised advantages over trajectories of the same group (task).

    A_i = (R_i - mean_g) / (std_g + eps), with std_g the *sample* standard deviation
    (Bessel-corrected, divisor n_g - 1), as in GRPO/TRL. A group with a single trajectory or
    with zero reward spread carries no learning signal: its items get A = 0, keep = False,
    and the group counts in `n_skipped_groups`.

    Args:
        rewards: [M] float, one reward per trajectory.
        group_ids: [M] integer group (task) id per trajectory.
    Returns:
        (advantages [M] float, keep [M] bool, n_skipped_groups int)
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be 1-D of the same length, got "
            f"rewards{list(rewards.shape)} and group_ids{list(group_ids.shape)}"
        )
    rewards = rewards.to(torch.float64)
    if rewards.numel() == 0:
        return rewards.float(), torch.zeros(0, dtype=torch.bool), 0
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, rewards)
    means = sums / counts
    centred = rewards - means[inverse]
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, centred**2)
    var = sq / (counts - 1).clamp(min=1)
    std = var.sqrt()
    group_ok = (counts >= 2) & (std > _ZERO_SPREAD)
    keep = group_ok[inverse]
    adv = torch.where(keep, centred / (std[inverse] + eps), torch.zeros_like(centred))
    return adv.float(), keep, int((~group_ok).sum().item())


def broadcast_to_steps(trajectory_values: Tensor, step_trajectory_index: Tensor) -> Tensor:
    """Give every step its trajectory's value (advantage, keep flag, ...).

    Args:
        trajectory_values: [M] one value per trajectory.
        step_trajectory_index: [N] long, position in `trajectory_values` of each step's trajectory.
    Returns:
        [N] values, one per step.
    """
    return trajectory_values[step_trajectory_index]


def high_entropy_mask(step_entropy: Tensor, *, q: float = 0.8) -> Tensor:
    """Keep the top-q fraction of steps by mean token entropy (DART's high-entropy selection).

    Keeps k = ceil(q * N) steps (so any q > 0 keeps at least one step of a non-empty batch; a
    1e-9 slack keeps float products such as 0.7 * 10 = 7.000000000000001 from rounding up).
    Ties are broken deterministically: among equal entropies the earlier step is kept.

    Args:
        step_entropy: [N] float mean token entropy per step.
    Returns:
        keep [N] bool.
    """
    if not 0 < q <= 1:
        raise ValueError(f"q must be in (0, 1], got {q}")
    if step_entropy.dim() != 1:
        raise ValueError(f"step_entropy must be 1-D, got shape {list(step_entropy.shape)}")
    n = step_entropy.numel()
    k = min(n, math.ceil(q * n - 1e-9))
    keep = torch.zeros(n, dtype=torch.bool)
    # A stable descending sort keeps the original order among equal entropies.
    order = torch.sort(step_entropy.detach().cpu(), descending=True, stable=True).indices
    keep[order[:k]] = True
    return keep


def recenter_kept_advantages(
    advantages: Tensor, group_ids: Tensor, keep: Tensor, weights: Tensor
) -> Tensor:
    """Make the kept steps' advantages zero-mean again within each group.

    Group advantages sum to zero over a group's trajectories, so what successes and failures
    share (the format, the common tokens) gets no net push. A step filter that is correlated
    with the reward breaks that: the high-entropy filter drops confident steps, and on a
    small policy the confident steps are mostly the successful ones (measured here: it kept
    60% of successful and 81% of failed first steps), so the kept steps' advantages sum
    below zero and every update pushes probability away from whatever the policy samples.
    Subtracting the kept steps' weighted group mean restores the zero sum; the order of
    advantages within a group is unchanged. Dropped steps keep their (untrained) value.

    Args:
        advantages: [N] per-step advantages.
        group_ids: [N] group of each step.
        keep: [N] bool, steps that will be trained.
        weights: [N] each step's weight in the loss (1 / steps of its trajectory under
            trajectory aggregation, 1 under token aggregation).
    Returns:
        [N] advantages.
    """
    _check_same_shape(advantages=advantages, group_ids=group_ids, keep=keep, weights=weights)
    out = advantages.clone().to(torch.float64)
    if out.numel() == 0 or not bool(keep.any()):
        return out.to(advantages.dtype)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1
    w = torch.where(keep, weights.to(torch.float64), torch.zeros_like(out))
    total_w = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, w)
    total_wa = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, w * out)
    mean = torch.where(total_w > 0, total_wa / total_w.clamp(min=1e-12), torch.zeros_like(total_w))
    out = torch.where(keep, out - mean[inverse], out)
    return out.to(advantages.dtype)


def truncated_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, cap: float = 1.0
) -> Tensor:
    """Truncated importance weights for the rollout/trainer mismatch: w = min(pi_old/pi_rollout, C).

    Computed without gradient (the weight scales the loss, it is not optimised).

    Args:
        old_logprobs: [B, T] log pi_old(token) from the trainer.
        rollout_logprobs: [B, T] log pi_rollout(token) from the inference server.
        mask: [B, T] response tokens.
    Returns:
        w [B, T] float, 0 at masked positions.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    _check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    with torch.no_grad():
        log_ratio = (old_logprobs.detach() - rollout_logprobs.detach()).float()
        # Clamp before exp: a huge positive log-ratio would overflow, and it is capped anyway.
        w = torch.exp(log_ratio.clamp(max=math.log(cap))).clamp(max=cap)
        return w * mask.to(w.dtype)


# --- policy-gradient losses --------------------------------------------------------------


def _per_sequence(sample_weights: Tensor, logprobs: Tensor) -> Tensor:
    """Check sample_weights is [B] for logprobs [B, T]; detached, in logprobs' dtype."""
    if sample_weights.shape != logprobs.shape[:1]:
        raise ValueError(
            f"sample_weights must be [B]={list(logprobs.shape[:1])}, "
            f"got {list(sample_weights.shape)}"
        )
    return sample_weights.detach().to(logprobs.dtype)


def trajectory_step_weights(trajectory_ids: Tensor, keep: Tensor) -> Tensor:
    """Weights that make every trajectory count once, however many steps it has.

    With step-level samples and token-mean aggregation a trajectory weighs by its token count:
    a failed episode that wanders for 5 steps outweighs a 1-step success 5 to 1, so the
    group's advantages (which sum to 0 over trajectories) stop cancelling on what successes
    and failures share, and the update mostly pushes probability away from sampled text
    (entropy rises, the policy collapses; measured on MiniWoB++ with the tiny policy).
    Each kept step of a trajectory weighs 1 / (its trajectory's kept steps), so the weights
    of a trajectory add up to 1: with each step a token mean (PPO: divide by the step's
    tokens) and the sum divided by the sum of the weights (the number of trajectories), the
    loss is a mean over trajectories.

    Args:
        trajectory_ids: [N] trajectory (group member) of each step.
        keep: [N] bool, steps that are trained; the others get weight 0.
    Returns:
        weights [N] float64.
    """
    if trajectory_ids.dim() != 1 or keep.shape != trajectory_ids.shape:
        raise ValueError(
            f"trajectory_ids and keep must both be 1-D of the same length, got "
            f"{list(trajectory_ids.shape)} and {list(keep.shape)}"
        )
    if trajectory_ids.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    _, inverse = torch.unique(trajectory_ids, return_inverse=True)
    kept = keep.to(torch.float64)
    steps = torch.zeros(int(inverse.max().item()) + 1, dtype=torch.float64)
    steps = steps.index_add(0, inverse, kept)
    return kept / steps[inverse].clamp(min=1.0)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_weights: Tensor | None = None,
    sample_weights: Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, float]:
    """Token-level PPO clipped surrogate with asymmetric ("clip-higher") clipping.

    r_t = exp(logp_t - old_logp_t); per token
    loss_t = -w_t * min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A),
    aggregated as the mean over all unmasked tokens of the batch (token-mean, so long and short
    responses weigh per token), or sum / `normalizer` when given.

    Args:
        logprobs: [B, T] log pi_theta(token) (with gradient).
        old_logprobs: [B, T] log pi_old(token).
        advantages: [B] one advantage per sequence (step).
        mask: [B, T] response tokens.
        is_weights: [B, T] truncated IS weights, or None for 1.
        sample_weights: [B] a weight per sequence multiplied into its token losses, or None
            for 1 (trajectory aggregation: trajectory_step_weights / tokens of the step).
    Returns:
        (loss scalar tensor, clip_fraction float): the clip fraction is the share of unmasked
        tokens where the clipped term was selected (their gradient is zero).
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B]={list(logprobs.shape[:1])}, got {list(advantages.shape)}"
        )
    mask_f = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    adv = advantages.detach().to(logprobs.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    token_loss = -surrogate
    if is_weights is not None:
        _check_same_shape(logprobs=logprobs, is_weights=is_weights)
        token_loss = token_loss * is_weights.detach().to(logprobs.dtype)
    if sample_weights is not None:
        token_loss = token_loss * _per_sequence(sample_weights, logprobs).unsqueeze(1)
    loss = _masked_sum_over(token_loss, mask_f, normalizer)
    n_tokens = float(mask_f.sum().item())
    was_clipped = (clipped < unclipped).to(logprobs.dtype) * mask_f
    clip_fraction = float(was_clipped.sum().item()) / n_tokens if n_tokens else 0.0
    return loss, clip_fraction


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    is_weights: Tensor | None = None,
    sample_weights: Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, float]:
    """GSPO: sequence-level ratio s_i = exp(mean_t(logp - old_logp)) with sequence clipping.

    loss_i = -w_i * min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i), averaged over
    sequences that have at least one unmasked token (or summed / `normalizer`). The IS weight
    of a sequence, w_i, is the mean of its token weights over unmasked tokens: GSPO's ratio is
    a per-sequence quantity, so its correction is too.

    Args:
        logprobs: [B, T] log pi_theta(token) (with gradient).
        old_logprobs: [B, T] log pi_old(token).
        advantages: [B] one advantage per sequence.
        mask: [B, T] response tokens.
        is_weights: [B, T] truncated IS weights, or None for 1.
        sample_weights: [B] a weight per sequence multiplied into its loss, or None for 1.
    Returns:
        (loss scalar tensor, clip_fraction float over sequences).
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask)
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B]={list(logprobs.shape[:1])}, got {list(advantages.shape)}"
        )
    mask_f = mask.to(logprobs.dtype)
    lengths = mask_f.sum(dim=1)
    present = (lengths > 0).to(logprobs.dtype)
    safe_len = lengths.clamp(min=1.0)
    mean_log_ratio = ((logprobs - old_logprobs.detach()) * mask_f).sum(dim=1) / safe_len
    seq_ratio = torch.exp(mean_log_ratio)
    adv = advantages.detach().to(logprobs.dtype)
    unclipped = seq_ratio * adv
    clipped = seq_ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    seq_loss = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        _check_same_shape(logprobs=logprobs, is_weights=is_weights)
        seq_w = (is_weights.detach().to(logprobs.dtype) * mask_f).sum(dim=1) / safe_len
        seq_loss = seq_loss * seq_w
    if sample_weights is not None:
        seq_loss = seq_loss * _per_sequence(sample_weights, logprobs)
    loss = _masked_sum_over(seq_loss, present, normalizer)
    n_seq = float(present.sum().item())
    was_clipped = (clipped < unclipped).to(logprobs.dtype) * present
    clip_fraction = float(was_clipped.sum().item()) / n_seq if n_seq else 0.0
    return loss, clip_fraction


KL_TOKEN_MAX = 10.0


def kl_low_variance(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    normalizer: float | None = None,
    max_per_token: float = KL_TOKEN_MAX,
) -> Tensor:
    """k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1, token mean.

    Non-negative per token, unbiased, and low-variance (Schulman's k3) for tokens sampled
    from pi_theta. A token sampled by an older policy that pi_theta now finds unlikely but
    pi_ref likely (e.g. a step the start policy wrote, trained after the warm start moved
    the policy) makes exp(ref - logp) explode: `make run` measured a batch mean of 960 nats.
    Each token's term is therefore capped at `max_per_token` (as verl's low_var_kl does); a
    capped token adds no gradient.

    Args:
        logprobs: [B, T] log pi_theta(token) (with gradient).
        ref_logprobs: [B, T] log pi_ref(token).
        mask: [B, T] tokens to average over.
    Returns:
        scalar tensor.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    diff = ref_logprobs.detach() - logprobs
    k3 = (torch.exp(diff) - diff - 1.0).clamp(max=max_per_token)
    return _masked_sum_over(k3, mask.to(logprobs.dtype), normalizer)


def bc_loss(logprobs: Tensor, mask: Tensor, *, normalizer: float | None = None) -> Tensor:
    """Behaviour cloning: negative log-likelihood of demo response tokens, token mean.

    Args:
        logprobs: [B, T] log pi_theta(token) (with gradient).
        mask: [B, T] demo response tokens.
    Returns:
        scalar tensor.
    """
    _check_same_shape(logprobs=logprobs, mask=mask)
    return _masked_sum_over(-logprobs, mask.to(logprobs.dtype), normalizer)


@dataclass
class PolicyLoss:
    """The combined loss of one (micro-)batch and each of its terms."""

    loss: Tensor  # Scalar to backpropagate: pg + kl_coef * kl + bc_weight * bc.
    pg_loss: Tensor  # Scalar policy-gradient term.
    kl: Tensor  # Scalar k3 KL (0 when kl_coef == 0 or no ref logprobs).
    bc_loss: Tensor  # Scalar behaviour-cloning term (0 without bc tokens or bc_weight).
    clip_fraction: float  # Tokens (PPO) or sequences (GSPO) whose clipped term was selected.
    n_pg_tokens: int  # Unmasked tokens of the policy-gradient term.
    n_bc_tokens: int  # Unmasked tokens of the behaviour-cloning term.


def policy_loss(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    pg_mask: Tensor,
    loss_type: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_weights: Tensor | None = None,
    sample_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    bc_mask: Tensor | None = None,
    bc_weight: float = 0.0,
    token_normalizer: float | None = None,
    sequence_normalizer: float | None = None,
    bc_normalizer: float | None = None,
    pg_normalizer: float | None = None,
) -> PolicyLoss:
    """pg (PPO or GSPO) + kl_coef * KL(pi_theta || pi_ref) + bc_weight * BC.

    Args:
        logprobs, old_logprobs: [B, T]; advantages: [B]; pg_mask: [B, T] tokens of the pg and
        KL terms; is_weights, ref_logprobs: [B, T] or None; bc_mask: [B, T] demo tokens or None.
        token_normalizer: divisor of the PPO and KL sums (default: pg_mask tokens here).
        sequence_normalizer: divisor of the GSPO sum (default: sequences with pg tokens here).
        bc_normalizer: divisor of the BC sum (default: bc_mask tokens here).
        pg_normalizer: divisor of the pg sum only, overriding the two above for it (with
            trajectory sample_weights: the number of trajectories; the KL stays a token mean).
    Raises:
        ValueError: unknown loss_type, or kl_coef > 0 without ref_logprobs.
    """
    if loss_type == "ppo":
        pg, clip_fraction = ppo_clip_loss(
            logprobs,
            old_logprobs,
            advantages,
            pg_mask,
            clip_low=clip_low,
            clip_high=clip_high,
            is_weights=is_weights,
            sample_weights=sample_weights,
            normalizer=token_normalizer if pg_normalizer is None else pg_normalizer,
        )
    elif loss_type == "gspo":
        pg, clip_fraction = gspo_loss(
            logprobs,
            old_logprobs,
            advantages,
            pg_mask,
            clip_low=clip_low,
            clip_high=clip_high,
            is_weights=is_weights,
            sample_weights=sample_weights,
            normalizer=sequence_normalizer if pg_normalizer is None else pg_normalizer,
        )
    else:
        raise ValueError(f"loss_type must be 'ppo' or 'gspo', got {loss_type!r}")
    zero = logprobs.sum() * 0.0
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the reference policy)")
        kl = kl_low_variance(logprobs, ref_logprobs, pg_mask, normalizer=token_normalizer)
    else:
        kl = zero
    if bc_mask is not None and bc_weight > 0:
        bc = bc_loss(logprobs, bc_mask, normalizer=bc_normalizer)
        n_bc = int(bc_mask.sum().item())
    else:
        bc, n_bc = zero, 0
    total = pg + kl_coef * kl + bc_weight * bc
    return PolicyLoss(
        loss=total,
        pg_loss=pg,
        kl=kl,
        bc_loss=bc,
        clip_fraction=clip_fraction,
        n_pg_tokens=int(pg_mask.sum().item()),
        n_bc_tokens=n_bc,
    )
