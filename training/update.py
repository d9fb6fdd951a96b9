"""One trainer update: step-level GRPO with DART's curation, over injected model and log-probs.

`policy_update` takes step samples (see `core.samples.TrainSample`), decides which steps
train (`training.update_plan`: group advantages over trajectories of a task, high-entropy
selection), computes pi_old
(and reference) log-probs once with no gradient, then runs `ppo_epochs` x `mini_batches`
optimizer steps with gradient accumulation over micro-batches of `micro_batch` samples.
With one epoch in one optimizer step (the default) the policy has not moved when the
gradient pass runs, so pi_old is that pass's own log-probs, detached: no separate pass, and
each micro-batch's reference pass runs just before its gradient pass (the trainer then
encodes the micro-batch once for both).

The model layer supplies `logprob_fn(model, samples) -> (logprobs[B, T], entropy[B, T], mask[B, T])`
where `mask` marks the response tokens; the i-th True position of row b is the i-th token of
`samples[b].response_token_ids` (the tokens the rollout sampled; `response_text` is tokenized
only for a sample without them, such as a demo), which is how the inference server's
`rollout_logprobs` line up.
`logprob_fn` must be deterministic for a given model state (dropout off) so the pi_old pass and
the training pass agree; `entropy` needs no gradient.

Run the tests: `.venv/bin/pytest -p no:django tests/training/test_update.py -q`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from core.losses import (
    policy_loss,
    truncated_is_weights,
)
from core.samples import TrainSample, UpdateMetrics
from training.ranges import UpdateConfig
from training.replicas import Replicas
from training.update_plan import UpdatePlan, plan_update

logger = logging.getLogger(__name__)

LogprobFn = Callable[[nn.Module, Sequence[TrainSample]], tuple[Tensor, Tensor, Tensor]]


class UpdateInterrupted(RuntimeError):
    """`policy_update`'s `stop()` said to stop (the worker shuts down): the update ended
    between two micro-batches. No optimizer step was taken unless the message says so; the
    caller drops what it held in memory and resumes from the last published version."""


def _check_stop(stop: Callable[[], bool] | None, steps_taken: int) -> None:
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
class _TokenStats:
    """Per-sample results of the pi_old pass: 1-D tensors over the response tokens."""

    old: Tensor
    ref: Tensor | None
    is_weight: Tensor | None
    entropy_sum: float
    # |log pi_old - log pi_rollout| per token, where the rollout's log-probs line up.
    gap: Tensor | None = None

    def to(self, device: torch.device | str) -> _TokenStats:
        return _TokenStats(
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


def _chunks(items: Sequence[int], n_parts: int) -> list[list[int]]:
    """Split into n_parts near-equal consecutive parts, dropping empty ones."""
    size, extra = divmod(len(items), n_parts)
    parts, start = [], 0
    for p in range(n_parts):
        end = start + size + (1 if p < extra else 0)
        if end > start:
            parts.append(list(items[start:end]))
        start = end
    return parts


def _batches(items: Sequence[int], size: int) -> list[list[int]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def _scatter(rows: Sequence[Tensor], mask: Tensor) -> Tensor:
    """Place per-sample 1-D token values at the True positions of mask [B, T] -> [B, T]."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    # Boolean indexing walks row-major: row b's True positions in order, then row b+1's.
    out[mask] = torch.cat([r.to(out.device, torch.float32) for r in rows])
    return out


def _sample_stats(
    sample: TrainSample, *, old: Tensor, ref: Tensor | None, entropy: Tensor, config: UpdateConfig
) -> tuple[_TokenStats, bool]:
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
    if config.truncated_is:
        if rollout_t is not None:
            ones = torch.ones_like(old)
            weight = truncated_is_weights(
                old[None], rollout_t[None], ones[None], cap=config.is_cap
            )[0]
        else:
            # Demos from the pool often have no rollout log-probs: nothing to correct.
            if not (sample.is_demo and not rollout):
                misaligned = True
                logger.warning(
                    "step %s: %d rollout logprobs for %d response tokens; IS weight set to 1",
                    sample.step_id, len(rollout), old.numel(),
                )  # fmt: skip
            weight = torch.ones_like(old)
    stats = _TokenStats(
        old=old,
        ref=ref,
        is_weight=weight,
        entropy_sum=float(entropy.float().sum().item()),
        gap=gap,
    )
    return stats, misaligned


def _micro_stats(
    stats: dict[int, _TokenStats],
    samples: Sequence[TrainSample],
    micro: Sequence[int],
    logprobs: Tensor,
    ref_logprobs: Tensor | None,
    entropy: Tensor,
    mask: Tensor,
    config: UpdateConfig,
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
            config=config,
        )
        misaligned += off
    return misaligned


def _pi_old_pass(
    *,
    model: nn.Module,
    ref_model: nn.Module | None,
    samples: Sequence[TrainSample],
    order: Sequence[int],
    logprob_fn: LogprobFn,
    config: UpdateConfig,
    seconds: dict[str, float],
    replicas: Replicas | None = None,
    stop: Callable[[], bool] | None = None,
) -> tuple[dict[int, _TokenStats], int]:
    """Log-probs of pi_old (and pi_ref) for the samples in `order`, no gradient, plus IS weights.
    With `replicas`, each computes its share of the micro-batches and all get every result.
    Adds the seconds of its policy and reference forward passes to `seconds` ("old", "ref").

    Returns per-sample stats (keyed by sample index) and the count of steps whose
    `rollout_logprobs` do not line up with their response tokens (their IS weight is 1).
    """
    stats: dict[int, _TokenStats] = {}
    misaligned = 0
    micros = _batches(order, config.micro_batch)
    with torch.no_grad():
        for micro, counts in replicas.deal(micros) if replicas else [(m, True) for m in micros]:
            _check_stop(stop, 0)
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
            misaligned += _micro_stats(stats, samples, micro, logprobs, ref_logprobs, entropy,
                                       mask, config)  # fmt: skip
    if replicas is not None:
        stats, misaligned = _merged(model, stats, misaligned, replicas)
    return stats, misaligned


def _merged(
    model: nn.Module, stats: dict[int, _TokenStats], misaligned: int, replicas: Replicas
) -> tuple[dict[int, _TokenStats], int]:
    """Every replica's share of the per-sample stats, on every replica."""
    device = next(model.parameters()).device
    gathered = replicas.merge({i: s.to("cpu") for i, s in stats.items()})
    return {i: s.to(device) for i, s in gathered.items()}, int(replicas.sum_floats([misaligned])[0])


@dataclass
class _StepTotals:
    """Sums over one optimizer step's micro-batches (each already normalised)."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    bc_loss: float = 0.0
    clipped: float = 0.0  # Clipped tokens (PPO) or sequences (GSPO).
    clip_units: float = 0.0  # Their denominator.
    grad_s: float = 0.0  # Seconds in the gradient passes (forward and backward).
    optimizer_s: float = 0.0  # Seconds in the gradient sum, clipping and optimizer step.


@dataclass
class _FusedRef:
    """The reference pass run micro-batch by micro-batch inside the gradient pass, when the
    separate pi_old pass is skipped; counts what `_pi_old_pass` would have returned."""

    ref_model: nn.Module | None
    logprob_fn: LogprobFn
    config: UpdateConfig
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


def _optimizer_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TrainSample],
    part: Sequence[int],
    plan: UpdatePlan,
    stats: dict[int, _TokenStats],
    n_tokens: dict[int, int],
    logprob_fn: LogprobFn,
    config: UpdateConfig,
    fused_ref: _FusedRef | None = None,
    replicas: Replicas | None = None,
    stop: Callable[[], bool] | None = None,
    steps_taken: int = 0,
) -> tuple[_StepTotals, float]:
    """Accumulate gradients over the micro-batches of `part`, clip, step. Returns totals, norm.
    With `replicas`, each takes its share of the micro-batches and the gradients (and totals)
    are summed before clipping, so every replica takes the same step.

    `n_tokens`: each sample's response tokens. With `fused_ref` the pi_old pass did not run:
    each micro-batch's reference pass runs just before its gradient pass (the trainer then
    encodes the micro-batch once for both), and the gradient pass's own log-probs, detached,
    are pi_old's, filling `stats` (and `fused_ref.misaligned`) as it goes.

    Long because it is one accumulation pass whose running totals are its locals."""
    use_bc = config.bc_weight > 0
    pg_items = [i for i in part if plan.pg_keep[i]]
    token_norm = float(sum(n_tokens[i] for i in pg_items))
    seq_norm = float(sum(1 for i in pg_items if n_tokens[i] > 0))
    bc_norm = float(sum(n_tokens[i] for i in part if use_bc and samples[i].is_demo))
    clip_low, clip_high = config.pg_clip
    weight_of: dict[int, float] = {}
    pg_norm = None
    if config.aggregation == "trajectory" and pg_items:
        # Each step a token mean (PPO) and each trajectory the mean of its steps; the sum of
        # the part's step weights is its number of trajectories (when no part splits one).
        for i in pg_items:
            n_tok = n_tokens[i]
            if n_tok:
                weight_of[i] = plan.step_weight[i] / (n_tok if config.loss_type == "ppo" else 1)
        pg_norm = sum(plan.step_weight[i] for i in weight_of)
    totals = _StepTotals()
    optimizer.zero_grad(set_to_none=True)
    micros = _batches(part, config.micro_batch)
    for micro, counts in replicas.deal(micros) if replicas else [(m, True) for m in micros]:
        _check_stop(stop, steps_taken)
        micro_samples = [samples[i] for i in micro]
        ref_logprobs = fused_ref.logprobs(micro_samples) if fused_ref is not None else None
        started = time.perf_counter()
        logprobs, entropy, mask = logprob_fn(model, micro_samples)
        if not counts:  # a sharded replica's lockstep pass: gradients of zero
            (logprobs.sum() * 0.0).backward()
            continue
        mask = mask.bool()
        for b, i in enumerate(micro):
            if int(mask[b].sum().item()) != n_tokens[i]:
                raise RuntimeError(
                    f"logprob_fn gave step {samples[i].step_id} {int(mask[b].sum().item())} "
                    f"response tokens in the training pass but {n_tokens[i]} in the "
                    "pi_old pass: it must tokenize a sample the same way every time"
                )
        if fused_ref is not None:
            fused_ref.misaligned += _micro_stats(stats, samples, micro, logprobs.detach(),
                                                 ref_logprobs, entropy, mask, config)  # fmt: skip
        device = logprobs.device
        pg_rows = torch.tensor([plan.pg_keep[i] for i in micro], device=device)
        pg_mask = mask & pg_rows[:, None]
        bc_mask = None
        if use_bc:
            demo_rows = torch.tensor([samples[i].is_demo for i in micro], device=device)
            bc_mask = mask & demo_rows[:, None]
        advantages = torch.tensor(
            [plan.advantage[i] if plan.pg_keep[i] else 0.0 for i in micro],
            dtype=torch.float32,
            device=device,
        )
        sample_weights = None
        if weight_of:
            sample_weights = torch.tensor(
                [weight_of.get(i, 0.0) for i in micro], dtype=torch.float32, device=device
            )
        is_weights = None
        if config.truncated_is:
            is_weights = _scatter([stats[i].is_weight for i in micro], mask)  # type: ignore[misc]
        ref = None
        if config.kl_coef > 0:
            ref = _scatter([stats[i].ref for i in micro], mask)  # type: ignore[misc]
        out = policy_loss(
            logprobs=logprobs.float(),
            old_logprobs=_scatter([stats[i].old for i in micro], mask),
            advantages=advantages,
            pg_mask=pg_mask,
            loss_type=config.loss_type,
            clip_low=clip_low,
            clip_high=clip_high,
            is_weights=is_weights,
            sample_weights=sample_weights,
            ref_logprobs=ref,
            kl_coef=config.kl_coef,
            bc_mask=bc_mask,
            bc_weight=config.bc_weight,
            token_normalizer=token_norm,
            sequence_normalizer=seq_norm,
            bc_normalizer=bc_norm,
            pg_normalizer=pg_norm,
        )
        if out.loss.requires_grad:
            out.loss.backward()
        totals.grad_s += time.perf_counter() - started
        totals.loss += float(out.loss.item())
        totals.pg_loss += float(out.pg_loss.item())
        totals.kl += float(out.kl.item())
        totals.bc_loss += float(out.bc_loss.item())
        units = out.n_pg_tokens if config.loss_type == "ppo" else int(pg_mask.any(dim=1).sum())
        totals.clipped += out.clip_fraction * units
        totals.clip_units += units
    _check_stop(stop, steps_taken)
    started = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    if replicas is not None:
        replicas.sum_gradients(params)
        totals = _StepTotals(*replicas.sum_floats(dataclasses.astuple(totals)))
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    totals.optimizer_s += time.perf_counter() - started
    return totals, float(grad_norm)


def _pi_old_metrics(
    metrics: UpdateMetrics,
    *,
    samples: Sequence[TrainSample],
    order: Sequence[int],
    plan: UpdatePlan,
    stats: dict[int, _TokenStats],
    config: UpdateConfig,
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
    if not config.truncated_is:
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


def policy_update(
    *,
    model: nn.Module,
    ref_model: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TrainSample],
    logprob_fn: LogprobFn,
    config: UpdateConfig,
    policy_version: int | None = None,
    replicas: Replicas | None = None,
    separate_old_pass: bool = False,
    stop: Callable[[], bool] | None = None,
) -> UpdateMetrics:
    """Run one policy update on `samples` and return what it did.

    Args:
        model: the policy pi_theta (trained in place; dropout should be off).
        ref_model: frozen reference policy for the KL term; may be None when kl_coef == 0.
        optimizer: over model's parameters (AdamW in the trainer).
        samples: the batch's steps; every trajectory's steps should be present together with
            the other trajectories of its task (the group).
        logprob_fn: see the module docstring.
        policy_version: the version being trained (pi_old), for the staleness histogram;
            default: the newest version among the online samples.
        replicas: data-parallel replicas (`training.replicas`): every replica calls this with
            the same samples and config, and all take the same optimizer steps.
        separate_old_pass: compute pi_old in a pass of its own even where the gradient pass
            gives it (one epoch, one optimizer step, every sample's response tokens known):
            the baseline `bench/update_cost.py` compares against; the step is the same.
        stop: asked before each micro-batch and each optimizer step; True ends the update
            with UpdateInterrupted (a worker shutting down need not finish a long update).
            Not with replicas: they would be left waiting in a collective.
    Returns:
        UpdateMetrics. With nothing to train (every group skipped, no BC) no optimizer step is
        taken and `optimizer_steps` is 0; the per-step decisions are still filled in.
    Raises:
        ValueError: no samples, kl_coef > 0 without ref_model, inconsistent trajectory rewards.
        UpdateInterrupted: `stop()` said so.

    Long because it is the update algorithm read top to bottom (advantages, step
    selection, old and reference log-probs, epochs); its stages share the samples' index
    maps.
    """
    if not samples:
        raise ValueError("policy_update needs at least one sample")
    if stop is not None and replicas is not None:
        raise ValueError("policy_update: stop is for a single process, not replicas")
    if config.kl_coef > 0 and ref_model is None:
        raise ValueError(
            f"UpdateConfig.kl_coef={config.kl_coef} needs a reference model: pass ref_model "
            "(a frozen copy of the initial policy), or set kl_coef=0 to train without the KL term"
        )
    started = time.perf_counter()
    plan = plan_update(samples, config)
    use_bc = config.bc_weight > 0
    order = [i for i, s in enumerate(samples) if plan.pg_keep[i] or (use_bc and s.is_demo)]
    online = [s for s in samples if not s.is_demo]
    if policy_version is None:
        policy_version = max((s.policy_version for s in online), default=0)
    metrics = UpdateMetrics(
        n_samples=len(samples),
        n_trained_steps=sum(plan.pg_keep),
        n_demo_steps=len(samples) - len(online),
        n_groups=plan.n_groups,
        skipped_groups=plan.skipped_groups,
        kept_step_fraction=sum(plan.pg_keep) / len(samples),
        staleness=dict(Counter(policy_version - s.policy_version for s in online)),
        step_kept={s.step_id: plan.pg_keep[i] for i, s in enumerate(samples)},
        step_entropy_kept=dict(plan.entropy_kept),
        step_advantage={s.step_id: plan.advantage[i] for i, s in enumerate(samples)},
    )
    trained_adv = torch.tensor([a for a, k in zip(plan.advantage, plan.pg_keep, strict=True) if k])
    if trained_adv.numel():
        metrics.advantage_mean = float(trained_adv.mean())
        metrics.advantage_std = float(trained_adv.std(correction=0))
        metrics.advantage_min = float(trained_adv.min())
        metrics.advantage_max = float(trained_adv.max())
    if not order:
        metrics.duration_s = time.perf_counter() - started
        return metrics

    if config.lr is not None:
        for param_group in optimizer.param_groups:
            param_group["lr"] = config.lr
    metrics.lr = float(optimizer.param_groups[0]["lr"])
    # One epoch in one optimizer step: the policy has not moved when the gradient pass runs,
    # so its log-probs are pi_old's and a separate pass would compute them again.
    fused = (
        not separate_old_pass
        and config.ppo_epochs == 1
        and config.mini_batches == 1
        and all(samples[i].response_token_ids for i in order)
    )
    seconds = {"old": 0.0, "ref": 0.0}
    fused_ref = None
    if fused:
        stats: dict[int, _TokenStats] = {}
        n_tokens = {i: len(samples[i].response_token_ids or ()) for i in order}
        fused_ref = _FusedRef(ref_model=ref_model, logprob_fn=logprob_fn, config=config)
    else:
        stats, metrics.is_misaligned_steps = _pi_old_pass(
            model=model,
            ref_model=ref_model,
            samples=samples,
            order=order,
            logprob_fn=logprob_fn,
            config=config,
            seconds=seconds,
            replicas=replicas,
            stop=stop,
        )
        n_tokens = {i: stats[i].old.numel() for i in order}
    sums = _StepTotals()
    for _epoch in range(config.ppo_epochs):
        for part in _chunks(order, config.mini_batches):
            totals, metrics.grad_norm = _optimizer_step(
                model=model,
                optimizer=optimizer,
                samples=samples,
                part=part,
                plan=plan,
                stats=stats,
                n_tokens=n_tokens,
                logprob_fn=logprob_fn,
                config=config,
                fused_ref=fused_ref,
                replicas=replicas,
                stop=stop,
                steps_taken=metrics.optimizer_steps,
            )
            metrics.optimizer_steps += 1
            for name in ("loss", "pg_loss", "kl", "bc_loss", "clipped", "clip_units"):
                setattr(sums, name, getattr(sums, name) + getattr(totals, name))
            sums.grad_s += totals.grad_s
            sums.optimizer_s += totals.optimizer_s
    if fused_ref is not None:
        seconds["ref"] = fused_ref.ref_s
        metrics.is_misaligned_steps = fused_ref.misaligned
        if replicas is not None:
            stats, metrics.is_misaligned_steps = _merged(
                model, stats, fused_ref.misaligned, replicas
            )
    ref_ran = ref_model is not None and config.kl_coef > 0
    metrics.passes = ("" if fused else "old+") + ("ref+" if ref_ran else "") + "grad"
    metrics.old_pass_s = seconds["old"]
    metrics.ref_pass_s = seconds["ref"]
    metrics.grad_pass_s = sums.grad_s
    metrics.optimizer_s = sums.optimizer_s
    _pi_old_metrics(metrics, samples=samples, order=order, plan=plan, stats=stats,
                    config=config, policy_version=policy_version)  # fmt: skip
    steps = metrics.optimizer_steps
    metrics.loss = sums.loss / steps
    metrics.pg_loss = sums.pg_loss / steps
    metrics.kl = sums.kl / steps
    metrics.bc_loss = sums.bc_loss / steps
    metrics.clip_fraction = sums.clipped / sums.clip_units if sums.clip_units else 0.0
    metrics.duration_s = time.perf_counter() - started
    metrics.samples_per_s = len(order) * config.ppo_epochs / metrics.duration_s
    return metrics
