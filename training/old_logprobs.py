"""pi_old and reference log-probs of one update (`training.update.policy_update`) and what
each sample gets from them: its importance-sampling weights against the rollout's log-probs
and the trainer-vs-rollout gap. Either a pass of their own before the optimizer steps
(`pi_old_pass`), or, with one epoch in one optimizer step, the gradient pass's own log-probs
with the reference pass run beside it (`FusedRef`). Also how an update stops between
micro-batches (`UpdateInterrupted`).

Run the tests: `.venv/bin/pytest tests/training/test_update.py -q`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from core.losses import truncated_is_weights
from core.samples import TrainSample, UpdateMetrics
from training.config import CPU_MICRO_BATCH_TOKENS, CurationConfig, TrainerConfig
from training.micro_batches import micro_batches
from training.replicas import Replicas
from training.update_plan import UpdatePlan

logger = logging.getLogger(__name__)

LogprobFn = Callable[[nn.Module, Sequence[TrainSample]], tuple[Tensor, Tensor, Tensor]]


class UpdateInterrupted(RuntimeError):
    """`policy_update`'s `stop()` said to stop (the worker shuts down): the update ended
    between two micro-batches. No optimizer step was taken unless the message says so; the
    caller drops what it held in memory and resumes from the last published version."""


def check_stop(stop: Callable[[], bool] | None, steps_taken: int) -> None:
    if stop is not None and stop():
        raise UpdateInterrupted(
            "update stopped between micro-batches ("
            + (
                f"{steps_taken} optimizer steps already taken"
                if steps_taken
                else "no optimizer step taken"
            )
            + ")"
        )


@dataclass
class TokenStats:
    """Per-sample results of the pi_old pass: 1-D tensors over the response tokens."""

    old: Tensor
    ref: Tensor | None
    is_weight: Tensor | None
    entropy_sum: float
    # |log pi_old - log pi_rollout| per token, where the rollout's log-probs line up.
    gap: Tensor | None = None

    def to(self, device: torch.device | str) -> TokenStats:
        return TokenStats(
            old=self.old.to(device),
            ref=None if self.ref is None else self.ref.to(device),
            is_weight=None if self.is_weight is None else self.is_weight.to(device),
            entropy_sum=self.entropy_sum,
            gap=None if self.gap is None else self.gap.to(device),
        )


def _logprob_gap(metrics: UpdateMetrics, gaps: list[Tensor | None]) -> None:
    """The trainer-vs-rollout log-prob gap on the steps sampled from the version being
    trained: there both sides hold the same weights, so only numerics separate them (bf16
    against fp32, kernels, batching). A worker that serves older weights while it reports the
    new version (TRL issue 5312) shows up here, where the IS weights would quietly absorb it."""
    measured = [g for g in gaps if g is not None and g.numel()]
    if not measured:
        return
    tokens = torch.cat(measured).float()
    metrics.logprob_gap_tokens = int(tokens.numel())
    metrics.logprob_gap_mean = float(tokens.mean())
    metrics.logprob_gap_p99 = float(torch.quantile(tokens.cpu(), 0.99))


def batches(
    items: Sequence[int], *, sample_tokens: Sequence[int] | None, config: TrainerConfig
) -> list[list[int]]:
    """The micro-batches of the samples `items` (indices into the update's samples), under
    the run's `micro_batch_tokens` and `micro_batch` (`training.micro_batches`).
    `sample_tokens`: each sample's tokens, index-aligned with the update's samples; None
    counts every sample as 0 tokens (a logprob_fn that knows no lengths: `micro_batch` alone)."""
    lengths = [sample_tokens[i] if sample_tokens is not None else 0 for i in items]
    # 0 (auto) reaches here only where no memory plan replaced it (a CPU trainer).
    budget = config.micro_batch_tokens or CPU_MICRO_BATCH_TOKENS
    groups = micro_batches(lengths, max_tokens=budget, max_samples=config.micro_batch)
    return [[items[p] for p in group] for group in groups]


def _sample_stats(
    sample: TrainSample,
    *,
    old: Tensor,
    ref: Tensor | None,
    entropy: Tensor,
    curation: CurationConfig,
) -> tuple[TokenStats, bool]:
    """One sample's pi_old statistics from its response tokens' log-probs (1-D, no gradient):
    the IS weights against the rollout's log-probs and the trainer-vs-rollout gap. Also
    whether its rollout log-probs fail to line up (then its IS weight is 1)."""
    weight = gap = rollout_t = None
    misaligned = False
    rollout = sample.rollout_logprobs
    if len(rollout) == old.numel():
        rollout_t = torch.tensor(rollout, dtype=torch.float32, device=old.device)
        if not sample.is_demo:
            gap = (old - rollout_t).abs()
    if curation.truncated_is:
        if rollout_t is not None:
            ones = torch.ones_like(old)
            weight = truncated_is_weights(
                old[None], rollout_t[None], ones[None], cap=curation.is_cap
            )[0]
        else:
            # Demos from the pool often have no rollout log-probs: nothing to correct.
            if not (sample.is_demo and not rollout):
                misaligned = True
                logger.warning(
                    "step %s: %d rollout logprobs for %d response tokens; IS weight set to 1",
                    sample.step_id,
                    len(rollout),
                    old.numel(),
                )
            weight = torch.ones_like(old)
    stats = TokenStats(
        old=old,
        ref=ref,
        is_weight=weight,
        entropy_sum=float(entropy.float().sum().item()),
        gap=gap,
    )
    return stats, misaligned


def micro_stats(
    stats: dict[int, TokenStats],
    samples: Sequence[TrainSample],
    micro: Sequence[int],
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    entropy: Tensor,
    mask: Tensor,
    curation: CurationConfig,
) -> int:
    """Fill `stats` for a micro-batch's samples from its pi_old log-probs [B, T] (no
    gradient); returns how many of them have misaligned rollout log-probs."""
    misaligned = 0
    for b, i in enumerate(micro):
        row = mask[b]
        stats[i], off = _sample_stats(
            samples[i],
            old=logprobs[b][row].float(),
            ref=None if ref_logprobs is None else ref_logprobs[b][row].float(),
            entropy=entropy[b][row],
            curation=curation,
        )
        misaligned += off
    return misaligned


def pi_old_pass(
    *,
    model: nn.Module,
    ref_model: nn.Module | None,
    samples: Sequence[TrainSample],
    order: Sequence[int],
    logprob_fn: LogprobFn,
    config: TrainerConfig,
    curation: CurationConfig,
    seconds: dict[str, float],
    sample_tokens: Sequence[int] | None = None,
    replicas: Replicas | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[dict[int, TokenStats], int]:
    """Log-probs of pi_old (and pi_ref) for the samples in `order`, no gradient, plus IS weights.
    With `replicas`, each computes its share of the micro-batches and all get every result.
    Adds the seconds of its policy and reference forward passes to `seconds` ("old", "ref").
    `sample_tokens`: as `batches` takes them.

    Returns per-sample stats (keyed by sample index) and the count of steps whose
    `rollout_logprobs` do not line up with their response tokens (their IS weight is 1).
    """
    stats: dict[int, TokenStats] = {}
    misaligned = 0
    micros = batches(order, sample_tokens=sample_tokens, config=config)
    with torch.no_grad():
        for micro, counts in replicas.deal(micros) if replicas else [(m, True) for m in micros]:
            check_stop(stop, 0)
            micro_samples = [samples[i] for i in micro]
            started = time.perf_counter()
            logprobs, entropy, mask = logprob_fn(model, micro_samples)
            mask = mask.bool()
            seconds["old"] += time.perf_counter() - started
            ref_logprobs = None
            if ref_model is not None and config.kl_coef > 0:
                started = time.perf_counter()
                ref_logprobs, _, _ = logprob_fn(ref_model, micro_samples)
                seconds["ref"] += time.perf_counter() - started
            if not counts:  # a sharded replica's lockstep pass
                continue
            misaligned += micro_stats(
                stats, samples, micro, logprobs, ref_logprobs, entropy, mask, curation
            )
    if replicas is not None:
        stats, misaligned = merged(model, stats, misaligned, replicas)
    return stats, misaligned


def merged(
    model: nn.Module, stats: dict[int, TokenStats], misaligned: int, replicas: Replicas
) -> tuple[dict[int, TokenStats], int]:
    """Every replica's share of the per-sample stats, on every replica."""
    device = next(model.parameters()).device
    gathered = replicas.merge({i: s.to("cpu") for i, s in stats.items()})
    return {i: s.to(device) for i, s in gathered.items()}, int(replicas.sum_floats([misaligned])[0])


@dataclass
class FusedRef:
    """The reference pass run micro-batch by micro-batch inside the gradient pass, when the
    separate pi_old pass is skipped; counts what `pi_old_pass` would have returned."""

    ref_model: nn.Module | None
    logprob_fn: LogprobFn
    config: TrainerConfig
    misaligned: int = 0
    ref_s: float = 0.0

    def logprobs(self, micro_samples: Sequence[TrainSample]) -> Tensor | None:
        if self.ref_model is None or self.config.kl_coef <= 0:
            return None
        started = time.perf_counter()
        with torch.no_grad():
            ref, _, _ = self.logprob_fn(self.ref_model, micro_samples)
        self.ref_s += time.perf_counter() - started
        return ref


def pi_old_metrics(
    metrics: UpdateMetrics,
    *,
    samples: Sequence[TrainSample],
    order: Sequence[int],
    plan: UpdatePlan,
    stats: dict[int, TokenStats],
    curation: CurationConfig,
    policy_version: int,
) -> None:
    """Tokens trained, pi_old's entropy, the trainer-vs-rollout gap and the IS weights."""
    pg_items = [i for i in order if plan.pg_keep[i]]
    metrics.n_tokens = sum(stats[i].old.numel() for i in pg_items)
    if metrics.n_tokens:
        metrics.mean_entropy = sum(stats[i].entropy_sum for i in pg_items) / metrics.n_tokens
    _logprob_gap(
        metrics, [stats[i].gap for i in order if samples[i].policy_version == policy_version]
    )
    if not curation.truncated_is:
        return
    for i in order:
        w = stats[i].is_weight
        if w is not None and w.numel():
            metrics.step_is_weight[samples[i].step_id] = float(w.mean())
    pg_w = [stats[i].is_weight for i in pg_items]
    all_w = torch.cat([w for w in pg_w if w is not None] or [torch.ones(0)])
    if all_w.numel():
        metrics.is_weight_mean = float(all_w.mean())
        metrics.is_weight_min = float(all_w.min())
        metrics.is_weight_max = float(all_w.max())
