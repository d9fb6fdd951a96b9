"""A run's training settings: the trainer (`trainer.*`: optimizer, schedule, loss, precision,
placement) and data curation (`curation.*`: DART's experience pool, budgets, entropy
selection, staleness, importance sampling). Part of `datamanager.config`'s `RunConfig`; how a
field is declared and checked is `datamanager.config_fields`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from datamanager.config_fields import check, in_update_range, knob, unused_knob
from training.ranges import UPDATE_DEFAULTS, Aggregation, LossType


@dataclass
class TrainerConfig:
    lr: float = knob(1e-5, "AdamW learning rate (the peak, under a schedule).")
    lr_schedule: Literal["constant", "cosine", "linear"] = knob(
        "constant",
        "Learning rate over updates: constant, or after the warm-up a cosine or linear decay "
        "to lr * lr_min_ratio over lr_decay_updates updates (then held there).",
    )
    lr_warmup_updates: int = knob(
        0, "Updates over which the learning rate rises linearly from lr / N to lr (0: none)."
    )
    lr_decay_updates: int = knob(
        0, "Updates after the warm-up over which a cosine or linear schedule decays."
    )
    lr_min_ratio: float = knob(0.1, "Where a decaying schedule ends, as a share of lr.")
    weight_decay: float = knob(0.0, "AdamW weight decay.")
    grad_clip: float = knob(UPDATE_DEFAULTS.max_grad_norm, "Gradient norm clipping.")
    stale_serving_alert: int = knob(
        3,
        "Alert on the run page when an episode under way is still sampled from a version this "
        "many versions behind the newest published one (0: off): a worker the weight sync missed.",
    )
    logprob_gap_alert: float = knob(
        0.1,
        "Alert on the run page when an update's mean trainer-vs-rollout log-prob gap per token, "
        "on steps of the version being trained, exceeds this (nats; 0: off). Same weights on "
        "both sides give numerical noise; a worker serving other weights than it reports does not.",
    )
    left_out_alert: float = knob(
        0.5,
        "Alert on the run page when the share of rollouts left out of training over the last 15 "
        "minutes (environment errors, aborted, rejected or labelled as environment bugs, or "
        "steps too stale to train) exceeds this (0: off).",
    )
    micro_batch: int = knob(
        UPDATE_DEFAULTS.micro_batch, "Steps per forward/backward (gradient accumulation unit)."
    )
    min_groups: int = knob(2, "Ready task groups needed before an update.")
    max_steps_per_update: int = knob(128, "Most steps trained in one update.")
    loss_type: LossType = knob(
        UPDATE_DEFAULTS.loss_type, "Token-level PPO clipping or GSPO sequence ratio."
    )
    loss_aggregation: Aggregation = knob(
        UPDATE_DEFAULTS.aggregation,
        "Every trajectory weighs the same, or DART's mean over all tokens (long episodes dominate).",
    )
    clip_low: float = knob(
        UPDATE_DEFAULTS.clip_low, "PPO: the token ratio is clipped below at 1 - clip_low."
    )
    clip_high: float = knob(
        UPDATE_DEFAULTS.clip_high, "PPO: the token ratio is clipped above at 1 + clip_high."
    )
    gspo_clip_low: float = knob(
        UPDATE_DEFAULTS.gspo_clip_low, "GSPO: the sequence ratio's lower clip range."
    )
    gspo_clip_high: float = knob(
        UPDATE_DEFAULTS.gspo_clip_high, "GSPO: the sequence ratio's upper clip range."
    )
    ppo_epochs: int = knob(
        UPDATE_DEFAULTS.ppo_epochs, "Passes over each batch (>1 lets the policy drift from pi_old)."
    )
    mini_batches: int = knob(
        UPDATE_DEFAULTS.mini_batches, "Optimizer steps per pass (the batch split into this many)."
    )
    kl_coef: float = knob(
        UPDATE_DEFAULTS.kl_coef,
        "KL to the initial policy (0 disables and frees the reference model; under LoRA the "
        "reference is the base with the adapters off, no second copy).",
    )
    bc_weight: float = knob(
        UPDATE_DEFAULTS.bc_weight, "Weight of the behaviour-cloning loss on experience-pool demos."
    )
    pool_mix_steps: int = knob(
        0,
        "Experience-pool demo steps (a new draw each update) mixed into every RL update and "
        "trained by behaviour cloning at bc_weight, an anchor against forgetting what "
        "pretraining taught (as InstructGPT's PPO-ptx mixes in pretraining data; 0: none).",
    )
    warm_start_bc_updates: int = knob(0, "Behaviour-cloning updates on the pool before RL.")
    checkpoint_every: int = knob(1, "Publish a PolicyVersion every N updates.")
    optimizer_states_kept: int = knob(
        2,
        "Published versions that keep their optimizer state (what a trainer resumes from; "
        "several times the weights under full fine-tuning); older versions keep only their "
        "weights.",
    )
    versions_kept: int = knob(
        0,
        "Published versions whose weights are kept, newest first (0: every version's). Older "
        "ones are deleted as new ones land, on disk and in the store, except every Nth "
        "(versions_keep_every), the best by greedy success and any under evaluation.",
    )
    versions_keep_every: int = knob(
        0, "With versions_kept: also keep every Nth version's weights (0: none besides)."
    )
    max_updates: int = knob(0, "Stop after N updates (0: until stopped).")
    bf16: bool = knob(True, "bf16 autocast on GPU (ignored on CPU).")
    lora_rank: int = knob(
        0, "LoRA adapter rank on the language model's projections (0: full fine-tuning)."
    )
    lora_alpha: int = knob(32, "LoRA scaling numerator (the update is scaled by alpha / rank).")
    lora_vision: bool = knob(False, "LoRA adapters on the vision tower too (else it is frozen).")
    gradient_checkpointing: bool = knob(
        False, "Recompute activations in the backward pass (less memory, about 30% more time)."
    )
    replicas: int = knob(
        1, "Data-parallel trainer processes, one per GPU (the worker starts N-1 followers)."
    )
    shard: bool = knob(
        False, "FSDP2: shard weights, gradients and AdamW state over the replicas (full FT)."
    )

    def __post_init__(self) -> None:
        """The section's checks, one per rule, in the order of its fields: long because the
        rules are many, and one list reads against the fields above."""
        in_update_range(self, "lr")
        check(
            self.lr_warmup_updates >= 0,
            "lr_warmup_updates",
            f"must be >= 0, got {self.lr_warmup_updates}",
        )
        check(
            self.pool_mix_steps >= 0, "pool_mix_steps", f"must be >= 0, got {self.pool_mix_steps}"
        )
        check(
            self.pool_mix_steps == 0 or self.bc_weight > 0,
            "pool_mix_steps",
            "needs bc_weight > 0: mixed-in demos train only through the behaviour-cloning term",
        )
        if self.lr_schedule == "constant":
            unused_knob(self, "lr_decay_updates", "under a constant lr_schedule")
            unused_knob(self, "lr_min_ratio", "under a constant lr_schedule")
        check(
            self.lr_decay_updates > 0 or self.lr_schedule == "constant",
            "lr_decay_updates",
            f"a {self.lr_schedule} schedule needs the updates it decays over (> 0), "
            f"got {self.lr_decay_updates}",
        )
        check(
            0 < self.lr_min_ratio <= 1,
            "lr_min_ratio",
            f"must be in (0, 1] (a zero rate would stop training), got {self.lr_min_ratio}",
        )
        check(
            self.stale_serving_alert >= 0,
            "stale_serving_alert",
            f"must be >= 0 (0 turns it off), got {self.stale_serving_alert}",
        )
        check(
            self.logprob_gap_alert >= 0,
            "logprob_gap_alert",
            f"must be >= 0 (0 turns it off), got {self.logprob_gap_alert}",
        )
        check(
            0 <= self.left_out_alert <= 1,
            "left_out_alert",
            f"must be a share from 0 to 1 (0 turns it off), got {self.left_out_alert}",
        )
        check(self.lora_rank >= 0, "lora_rank", f"must be >= 0, got {self.lora_rank}")
        check(1 <= self.replicas <= 64, "replicas", f"must be from 1 to 64, got {self.replicas}")
        if self.shard:
            check(self.replicas > 1, "shard", "needs replicas > 1 (one shard per replica)")
            check(self.lora_rank == 0, "shard", "is for full fine-tuning (set lora_rank 0)")
        if self.lora_rank == 0:
            unused_knob(self, "lora_alpha", "under full fine-tuning (set lora_rank)")
            unused_knob(self, "lora_vision", "under full fine-tuning (set lora_rank)")
        else:
            check(self.lora_alpha > 0, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        in_update_range(self, "grad_clip", "max_grad_norm")
        check(self.min_groups >= 1, "min_groups", "must be >= 1")
        check(self.max_steps_per_update >= 1, "max_steps_per_update", "must be >= 1")
        for name in ("micro_batch", "clip_low", "clip_high", "gspo_clip_low", "gspo_clip_high",
                     "ppo_epochs", "mini_batches", "kl_coef", "bc_weight"):  # fmt: skip
            in_update_range(self, name)
        if self.loss_type == "gspo":
            unused_knob(self, "clip_low", "under loss_type gspo (set gspo_clip_low)")
            unused_knob(self, "clip_high", "under loss_type gspo (set gspo_clip_high)")
        else:
            unused_knob(self, "gspo_clip_low", "under loss_type ppo (set clip_low)")
            unused_knob(self, "gspo_clip_high", "under loss_type ppo (set clip_high)")
        check(self.warm_start_bc_updates >= 0, "warm_start_bc_updates", "must be >= 0")
        check(self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
        check(
            self.optimizer_states_kept >= 1,
            "optimizer_states_kept",
            f"must be >= 1 (the newest version's state is what a restarted trainer resumes "
            f"from), got {self.optimizer_states_kept}",
        )
        check(self.versions_kept >= 0, "versions_kept", f"must be >= 0, got {self.versions_kept}")
        check(
            self.versions_kept == 0 or self.versions_kept >= self.optimizer_states_kept,
            "versions_kept",
            f"keeps fewer versions ({self.versions_kept}) than optimizer_states_kept "
            f"({self.optimizer_states_kept}): a version's state is useless without its weights",
        )
        check(
            self.versions_keep_every >= 0,
            "versions_keep_every",
            f"must be >= 0, got {self.versions_keep_every}",
        )
        if self.versions_kept == 0:
            unused_knob(
                self, "versions_keep_every", "while versions_kept is 0 (every version is kept)"
            )
        check(self.max_updates >= 0, "max_updates", "must be >= 0")


@dataclass
class CurationConfig:
    dynamic_budget: bool = knob(True, "Rollouts per task follow its success rate (DART rule).")
    n_max: int = knob(8, "Rollout budget of a task below the success threshold.")
    n_min: int = knob(2, "Smallest rollout budget.")
    budget_threshold: float = knob(0.6, "Success rate at which the budget starts to shrink.")
    dynamic_step_cap: bool = knob(True, "A task's step cap follows its longest success.")
    default_step_cap: int = knob(15, "Step cap while a task has no success yet.")
    step_cap_margin: int = knob(2, "Steps allowed beyond the longest success.")
    experience_pool: bool = knob(
        True, "Pool successes join groups whose online rollouts all failed."
    )
    pool_ratio: float = knob(0.25, "Share of a failed group replaced by pool trajectories.")
    high_entropy: bool = knob(True, "Train only on the highest-entropy steps.")
    entropy_top_q: float = knob(
        UPDATE_DEFAULTS.entropy_top_q, "Fraction of steps kept by the entropy filter."
    )
    entropy_recenter: bool = knob(
        UPDATE_DEFAULTS.entropy_recenter,
        "Re-centre the kept steps' advantages per group (the filter favours failures).",
    )
    truncated_is: bool = knob(
        UPDATE_DEFAULTS.truncated_is, "Truncated importance sampling for rollout/trainer mismatch."
    )
    is_cap: float = knob(UPDATE_DEFAULTS.is_cap, "Truncation C of the IS weight.")
    staleness_k: int = knob(2, "Train only on steps from versions >= current - k.")
    max_uses_per_step: int = knob(1, "How often one step may be trained on.")
    # Off for a run unless set: where it pays (env time scarce or costly, a trainer that
    # falls behind) is a property of the run. `make run`'s preset sets it
    # (hostagent/main_job.py); docs/benchmarks.md, *Backpressure on the main job*.
    backpressure: float = knob(
        0.0,
        "Open no new group while ready, untrained steps fill this many updates "
        "(trainer.max_steps_per_update each); a group already begun is still completed. "
        "0: never hold.",
    )
    success_window: int = knob(16, "Trajectories in a task's rolling success rate.")
    error_retries: int = knob(
        2,
        "A group member that ends in an environment error is replaced by a new rollout on a "
        "fresh environment, up to this many times per group; a group still missing a member "
        "is dropped (skipped, with the error), never trained without it.",
    )

    def __post_init__(self) -> None:
        check(1 <= self.n_min <= self.n_max, "n_min", "must satisfy 1 <= n_min <= n_max")
        check(self.n_max <= 64, "n_max", "must be <= 64")
        check(0 < self.budget_threshold <= 1, "budget_threshold", "must be in (0, 1]")
        check(self.default_step_cap >= 1, "default_step_cap", "must be >= 1")
        check(self.step_cap_margin >= 0, "step_cap_margin", "must be >= 0")
        check(0 <= self.pool_ratio <= 1, "pool_ratio", "must be in [0, 1]")
        in_update_range(self, "entropy_top_q")
        in_update_range(self, "is_cap")
        check(self.staleness_k >= 0, "staleness_k", "must be >= 0")
        check(self.max_uses_per_step >= 1, "max_uses_per_step", "must be >= 1")
        check(0 <= self.backpressure <= 100, "backpressure", "must be between 0 and 100")
        check(self.success_window >= 1, "success_window", "must be >= 1")
        check(0 <= self.error_retries <= 8, "error_retries", "must be between 0 and 8")
        if not self.truncated_is:
            unused_knob(self, "is_cap", "with truncated_is off")
        if not self.high_entropy:
            unused_knob(self, "entropy_top_q", "with high_entropy off")
            unused_knob(self, "entropy_recenter", "with high_entropy off")
        if not self.experience_pool:
            unused_knob(self, "pool_ratio", "with experience_pool off")
        if not self.dynamic_step_cap:
            unused_knob(self, "step_cap_margin", "with dynamic_step_cap off")
        if not self.dynamic_budget:
            unused_knob(self, "n_min", "with dynamic_budget off (every task gets n_max)")
            unused_knob(self, "budget_threshold", "with dynamic_budget off")
