"""One trainer update: step-level GRPO with DART's curation, over injected model and log-probs.

`policy_update` takes step samples (see `core.samples.TrainSample`) and the run's trainer and
curation settings as they are (`training.config`), decides which steps train
(`training.update_plan`: group advantages over trajectories of a task, high-entropy
selection), computes pi_old (and reference) log-probs once with no gradient
(`training.old_logprobs`), then runs `ppo_epochs` x `mini_batches` optimizer steps with
gradient accumulation over micro-batches of at most `micro_batch` samples and
`micro_batch_tokens` tokens (`training.micro_batches`), at the optimizer's learning rate (the
trainer's schedule sets it). Every loss term is normalised per optimizer step
(`_step_norms`), so how the step's samples are grouped into micro-batches changes no gradient. With one epoch in one optimizer step (the
default) the policy has not moved when the gradient pass runs, so pi_old is that pass's own
log-probs, detached: no separate pass, and each micro-batch's reference pass runs just
before its gradient pass (the trainer then encodes the micro-batch once for both).

The model layer supplies `logprob_fn(model, samples) -> (logprobs[B, T], entropy[B, T], mask[B, T])`
where `mask` marks the response tokens; the i-th True position of row b is the i-th token of
`samples[b].response_token_ids` (the tokens the rollout sampled; `response_text` is tokenized
only for a sample without them, such as a demo), which is how the inference server's
`rollout_logprobs` line up.
`logprob_fn` must be deterministic for a given model state (dropout off) so the pi_old pass and
the training pass agree; `entropy` needs no gradient.

Run the tests: `.venv/bin/pytest tests/training/test_update.py -q`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from core.losses import PolicyLoss, policy_loss
from core.samples import TrainSample, UpdateMetrics
from training.config import CurationConfig, TrainerConfig
from training.old_logprobs import (
    FusedRef,
    LogprobFn,
    TokenStats,
    UpdateInterrupted,
    batches,
    check_stop,
    merged,
    micro_stats,
    pi_old_metrics,
    pi_old_pass,
)
from training.replicas import Replicas
from training.update_plan import UpdatePlan, plan_update

__all__ = ["LogprobFn", "UpdateInterrupted", "policy_update"]


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


def _first_pass(
    order: Sequence[int],
    sample_tokens: Sequence[int] | None,
    config: TrainerConfig,
    replicas: Replicas | None,
) -> list[int]:
    """The samples this process's first pass over `order` takes, in its order: the pi_old
    pass and a fused gradient pass (one mini-batch) both deal `batches(order)` to the
    replicas. A sharded replica's lockstep repeats are left out (encoded already)."""
    micros = batches(order, sample_tokens=sample_tokens, config=config)
    dealt = replicas.deal(micros) if replicas else [(m, True) for m in micros]
    return [i for micro, counts in dealt if counts for i in micro]


def _scatter(rows: Sequence[Tensor], mask: Tensor) -> Tensor:
    """Place per-sample 1-D token values at the True positions of mask [B, T] -> [B, T]."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    # Boolean indexing walks row-major: row b's True positions in order, then row b+1's.
    out[mask] = torch.cat([r.to(out.device, torch.float32) for r in rows])
    return out


@dataclass
class _StepTotals:
    """Sums over one optimizer step's micro-batches (each already normalised), and over the
    update's steps."""

    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    bc_loss: float = 0.0
    clipped: float = 0.0  # Clipped tokens (PPO) or sequences (GSPO).
    clip_units: float = 0.0  # Their denominator.
    grad_s: float = 0.0  # Seconds in the gradient passes (forward and backward).
    optimizer_s: float = 0.0  # Seconds in the gradient sum, clipping and optimizer step.

    def add_loss(self, out: PolicyLoss, units: float) -> None:
        """One micro-batch's loss terms; `units`: its clip denominator."""
        self.loss += float(out.loss.item())
        self.pg_loss += float(out.pg_loss.item())
        self.kl += float(out.kl.item())
        self.bc_loss += float(out.bc_loss.item())
        self.clipped += out.clip_fraction * units
        self.clip_units += units

    def add(self, other: _StepTotals) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class _Norms:
    """One optimizer step's loss normalisers (`core.losses.policy_loss`) and, under trajectory
    aggregation, each policy-gradient step's weight."""

    token: float
    sequence: float
    bc: float
    pg: float | None
    weight_of: dict[int, float]


def _step_norms(
    part: Sequence[int],
    *,
    samples: Sequence[TrainSample],
    plan: UpdatePlan,
    n_tokens: dict[int, int],
    config: TrainerConfig,
) -> _Norms:
    """The normalisers of the optimizer step over `part`: its policy-gradient tokens and
    sequences and its demo tokens (behaviour cloning). Under trajectory aggregation each step
    is a token mean (PPO) and each trajectory the mean of its steps: the part's step weights
    sum to its number of trajectories (when no part splits one)."""
    pg_items = [i for i in part if plan.pg_keep[i]]
    weight_of: dict[int, float] = {}
    pg_norm = None
    if config.loss_aggregation == "trajectory" and pg_items:
        per_token = config.loss_type == "ppo"
        for i in pg_items:
            if n_tokens[i]:
                weight_of[i] = plan.step_weight[i] / (n_tokens[i] if per_token else 1)
        pg_norm = sum(plan.step_weight[i] for i in weight_of)
    use_bc = config.bc_weight > 0
    return _Norms(
        token=float(sum(n_tokens[i] for i in pg_items)),
        sequence=float(sum(1 for i in pg_items if n_tokens[i] > 0)),
        bc=float(sum(n_tokens[i] for i in part if use_bc and samples[i].is_demo)),
        pg=pg_norm,
        weight_of=weight_of,
    )


def _check_token_counts(
    micro: Sequence[int], mask: Tensor, samples: Sequence[TrainSample], n_tokens: dict[int, int]
) -> None:
    for b, i in enumerate(micro):
        if int(mask[b].sum().item()) != n_tokens[i]:
            raise RuntimeError(
                f"logprob_fn gave step {samples[i].step_id} {int(mask[b].sum().item())} "
                f"response tokens in the training pass but {n_tokens[i]} in the "
                "pi_old pass: it must tokenize a sample the same way every time"
            )


def _micro_loss(
    micro: Sequence[int],
    *,
    logprobs: Tensor,
    mask: Tensor,
    samples: Sequence[TrainSample],
    plan: UpdatePlan,
    stats: dict[int, TokenStats],
    norms: _Norms,
    config: TrainerConfig,
    curation: CurationConfig,
) -> tuple[PolicyLoss, float]:
    """The loss of micro-batch `micro` from its log-probs [B, T] (with gradient) and response
    `mask` [B, T], and its clip denominator (policy-gradient tokens under PPO, sequences
    under GSPO)."""
    device = logprobs.device
    pg_rows = torch.tensor([plan.pg_keep[i] for i in micro], device=device)
    pg_mask = mask & pg_rows[:, None]
    bc_mask = None
    if config.bc_weight > 0:
        demo_rows = torch.tensor([samples[i].is_demo for i in micro], device=device)
        bc_mask = mask & demo_rows[:, None]
    advantages = torch.tensor(
        [plan.advantage[i] if plan.pg_keep[i] else 0.0 for i in micro],
        dtype=torch.float32,
        device=device,
    )
    sample_weights = None
    if norms.weight_of:
        sample_weights = torch.tensor(
            [norms.weight_of.get(i, 0.0) for i in micro], dtype=torch.float32, device=device
        )
    is_weights = None
    if curation.truncated_is:
        is_weights = _scatter([stats[i].is_weight for i in micro], mask)  # type: ignore[misc]
    ref = None
    if config.kl_coef > 0:
        ref = _scatter([stats[i].ref for i in micro], mask)  # type: ignore[misc]
    clip_low, clip_high = config.pg_clip
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
        token_normalizer=norms.token,
        sequence_normalizer=norms.sequence,
        bc_normalizer=norms.bc,
        pg_normalizer=norms.pg,
    )
    units = out.n_pg_tokens if config.loss_type == "ppo" else int(pg_mask.any(dim=1).sum())
    return out, units


def _take_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    totals: _StepTotals,
    *,
    config: TrainerConfig,
    replicas: Replicas | None,
) -> tuple[_StepTotals, float]:
    """Sum the replicas' gradients (and totals), clip at `grad_clip`, step. Returns the
    totals and the gradient norm before clipping."""
    started = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    if replicas is not None:
        replicas.sum_gradients(params)
        totals = _StepTotals(*replicas.sum_floats(dataclasses.astuple(totals)))
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    totals.optimizer_s += time.perf_counter() - started
    return totals, float(grad_norm)


def _optimizer_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TrainSample],
    part: Sequence[int],
    plan: UpdatePlan,
    stats: dict[int, TokenStats],
    n_tokens: dict[int, int],
    logprob_fn: LogprobFn,
    config: TrainerConfig,
    curation: CurationConfig,
    sample_tokens: Sequence[int] | None = None,
    fused_ref: FusedRef | None = None,
    replicas: Replicas | None = None,
    stop: Callable[[], bool] | None = None,
    steps_taken: int = 0,
) -> tuple[_StepTotals, float]:
    """Accumulate gradients over the micro-batches of `part`, clip, step. Returns totals, norm.
    With `replicas`, each takes its share of the micro-batches and the gradients (and totals)
    are summed before clipping, so every replica takes the same step.

    `n_tokens`: each sample's response tokens; `sample_tokens`: each sample's tokens in all,
    what the micro-batches' token budget counts (`batches`). With `fused_ref` the pi_old pass did not run:
    each micro-batch's reference pass runs just before its gradient pass (the trainer then
    encodes the micro-batch once for both), and the gradient pass's own log-probs, detached,
    are pi_old's, filling `stats` (and `fused_ref.misaligned`) as it goes."""
    norms = _step_norms(part, samples=samples, plan=plan, n_tokens=n_tokens, config=config)
    totals = _StepTotals()
    optimizer.zero_grad(set_to_none=True)
    micros = batches(part, sample_tokens=sample_tokens, config=config)
    for micro, counts in replicas.deal(micros) if replicas else [(m, True) for m in micros]:
        check_stop(stop, steps_taken)
        micro_samples = [samples[i] for i in micro]
        ref_logprobs = fused_ref.logprobs(micro_samples) if fused_ref is not None else None
        started = time.perf_counter()
        logprobs, entropy, mask = logprob_fn(model, micro_samples)
        if not counts:  # a sharded replica's lockstep pass: gradients of zero
            (logprobs.sum() * 0.0).backward()
            continue
        mask = mask.bool()
        _check_token_counts(micro, mask, samples, n_tokens)
        if fused_ref is not None:
            fused_ref.misaligned += micro_stats(
                stats, samples, micro, logprobs.detach(), ref_logprobs, entropy, mask, curation
            )
        out, units = _micro_loss(
            micro,
            logprobs=logprobs,
            mask=mask,
            samples=samples,
            plan=plan,
            stats=stats,
            norms=norms,
            config=config,
            curation=curation,
        )
        if out.loss.requires_grad:
            out.loss.backward()
        totals.grad_s += time.perf_counter() - started
        totals.add_loss(out, units)
    check_stop(stop, steps_taken)
    return _take_step(model, optimizer, totals, config=config, replicas=replicas)


def _check_inputs(
    samples: Sequence[TrainSample],
    *,
    ref_model: nn.Module | None,
    config: TrainerConfig,
    replicas: Replicas | None,
    stop: Callable[[], bool] | None,
    sample_tokens: Sequence[int] | None,
) -> None:
    if not samples:
        raise ValueError("policy_update needs at least one sample")
    if stop is not None and replicas is not None:
        raise ValueError("policy_update: stop is for a single process, not replicas")
    if sample_tokens is not None and len(sample_tokens) != len(samples):
        raise ValueError(
            f"policy_update: {len(sample_tokens)} sample_tokens for {len(samples)} samples"
        )
    if config.kl_coef > 0 and ref_model is None:
        raise ValueError(
            f"kl_coef={config.kl_coef} needs a reference model: pass ref_model (a frozen copy "
            "of the initial policy), or set kl_coef=0 to train without the KL term"
        )


def _plan_metrics(
    samples: Sequence[TrainSample], plan: UpdatePlan, policy_version: int
) -> UpdateMetrics:
    """What the plan decided, per step and in all: kept steps, groups, advantages, staleness."""
    online = [s for s in samples if not s.is_demo]
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
    return metrics


def _step_metrics(
    metrics: UpdateMetrics, sums: _StepTotals, seconds: dict[str, float], passes: str
) -> None:
    """The passes run, their seconds, and the loss terms averaged over the optimizer steps."""
    metrics.passes = passes
    metrics.old_pass_s = seconds["old"]
    metrics.ref_pass_s = seconds["ref"]
    metrics.grad_pass_s = sums.grad_s
    metrics.optimizer_s = sums.optimizer_s
    steps = metrics.optimizer_steps
    metrics.loss = sums.loss / steps
    metrics.pg_loss = sums.pg_loss / steps
    metrics.kl = sums.kl / steps
    metrics.bc_loss = sums.bc_loss / steps
    metrics.clip_fraction = sums.clipped / sums.clip_units if sums.clip_units else 0.0


def policy_update(
    *,
    model: nn.Module,
    ref_model: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TrainSample],
    logprob_fn: LogprobFn,
    config: TrainerConfig,
    curation: CurationConfig,
    policy_version: int | None = None,
    replicas: Replicas | None = None,
    separate_old_pass: bool = False,
    stop: Callable[[], bool] | None = None,
    sample_tokens: Sequence[int] | None = None,
    encode_ahead: Callable[[list[TrainSample]], None] | None = None,
) -> UpdateMetrics:
    """Run one policy update on `samples` and return what it did.

    Args:
        model: the policy pi_theta (trained in place; dropout should be off).
        ref_model: frozen reference policy for the KL term; may be None when kl_coef == 0.
        optimizer: over model's parameters (AdamW in the trainer), at this update's learning
            rate (the trainer's schedule sets it; this function never does).
        samples: the batch's steps; every trajectory's steps should be present together with
            the other trajectories of its task (the group).
        logprob_fn: see the module docstring.
        config, curation: the run's trainer settings (the loss, micro-batches, epochs,
            clipping) and its curation settings (the entropy filter, importance sampling).
        policy_version: the version being trained (pi_old), for the staleness histogram;
            default: the newest version among the online samples.
        replicas: data-parallel replicas (`training.replicas`): every replica calls this with
            the same samples and settings, and all take the same optimizer steps.
        separate_old_pass: compute pi_old in a pass of its own even where the gradient pass
            gives it (one epoch, one optimizer step, every sample's response tokens known):
            the baseline `bench/update_cost.py` compares against; the step is the same.
        stop: asked before each micro-batch and each optimizer step; True ends the update
            with UpdateInterrupted (a worker shutting down need not finish a long update).
            Not with replicas: they would be left waiting in a collective.
        sample_tokens: each sample's tokens, prompt and reply, image tokens included
            (index-aligned with `samples`): micro-batches hold at most `micro_batch_tokens`
            of them. None: `micro_batch` alone forms the micro-batches (a logprob_fn whose
            samples have no token lengths, as tests' toy models).
        encode_ahead: given, before the first pass, the samples this process's first pass
            takes, in its order (a replica's share only), so their prompts can be encoded
            ahead of it (`training.prompt_cache.PromptCache.prefetch`).
    Returns:
        UpdateMetrics. With nothing to train (every group skipped, no BC) no optimizer step is
        taken and `optimizer_steps` is 0; the per-step decisions are still filled in.
    Raises:
        ValueError: no samples, kl_coef > 0 without ref_model, inconsistent trajectory rewards.
        UpdateInterrupted: `stop()` said so.

    Its phases: the plan (advantages, step selection), pi_old and reference log-probs (a
    pass of their own, or fused into the gradient pass), the epochs' optimizer steps, the
    metrics.
    """
    _check_inputs(
        samples,
        ref_model=ref_model,
        config=config,
        replicas=replicas,
        stop=stop,
        sample_tokens=sample_tokens,
    )
    started = time.perf_counter()
    plan = plan_update(samples, config, curation)
    use_bc = config.bc_weight > 0
    order = [i for i, s in enumerate(samples) if plan.pg_keep[i] or (use_bc and s.is_demo)]
    if policy_version is None:
        policy_version = max((s.policy_version for s in samples if not s.is_demo), default=0)
    metrics = _plan_metrics(samples, plan, policy_version)
    if not order:
        metrics.duration_s = time.perf_counter() - started
        return metrics

    metrics.lr = float(optimizer.param_groups[0]["lr"])  # as the trainer's schedule set it
    # One epoch in one optimizer step: the policy has not moved when the gradient pass runs,
    # so its log-probs are pi_old's and a separate pass would compute them again.
    fused = (
        not separate_old_pass
        and config.ppo_epochs == 1
        and config.mini_batches == 1
        and all(samples[i].response_token_ids for i in order)
    )
    if encode_ahead is not None:
        encode_ahead([samples[i] for i in _first_pass(order, sample_tokens, config, replicas)])
    seconds = {"old": 0.0, "ref": 0.0}
    fused_ref = None
    if fused:
        stats: dict[int, TokenStats] = {}
        n_tokens = {i: len(samples[i].response_token_ids or ()) for i in order}
        fused_ref = FusedRef(ref_model=ref_model, logprob_fn=logprob_fn, config=config)
    else:
        stats, metrics.is_misaligned_steps = pi_old_pass(
            model=model,
            ref_model=ref_model,
            samples=samples,
            order=order,
            logprob_fn=logprob_fn,
            config=config,
            curation=curation,
            seconds=seconds,
            sample_tokens=sample_tokens,
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
                curation=curation,
                sample_tokens=sample_tokens,
                fused_ref=fused_ref,
                replicas=replicas,
                stop=stop,
                steps_taken=metrics.optimizer_steps,
            )
            metrics.optimizer_steps += 1
            sums.add(totals)
    if fused_ref is not None:
        seconds["ref"] = fused_ref.ref_s
        metrics.is_misaligned_steps = fused_ref.misaligned
        if replicas is not None:
            stats, metrics.is_misaligned_steps = merged(
                model, stats, fused_ref.misaligned, replicas
            )
    ref_ran = ref_model is not None and config.kl_coef > 0
    _step_metrics(
        metrics, sums, seconds, ("" if fused else "old+") + ("ref+" if ref_ran else "") + "grad"
    )
    pi_old_metrics(
        metrics,
        samples=samples,
        order=order,
        plan=plan,
        stats=stats,
        curation=curation,
        policy_version=policy_version,
    )
    metrics.duration_s = time.perf_counter() - started
    metrics.samples_per_s = len(order) * config.ppo_epochs / metrics.duration_s
    return metrics
