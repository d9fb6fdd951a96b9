"""A run's training settings, as the run form, the run's JSON and the trainer take them: the
trainer (`trainer.*`: optimizer, schedule, loss, precision, placement) and data curation
(`curation.*`: DART's experience pool, budgets, entropy selection, staleness, importance
sampling). `datamanager.config.RunConfig` holds one of each; `PolicyTrainer` and
`policy_update` take them as they are, so a setting has one name and one check from the form
to the optimizer. How a field is declared and checked is `core.config_fields`'s. No torch
here: the web process validates run forms with it.

    .venv/bin/python -c "from training.config import TrainerConfig; TrainerConfig(lr=0)"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from core.config_fields import check, knob, unused_knob
from core.lora import LoraSpec

LossType = Literal["ppo", "gspo"]  # "ppo": token-level clipped ratio; "gspo": sequence-level
# "trajectory": every trajectory weighs the same; "token": DART's mean over all tokens.
Aggregation = Literal["trajectory", "token"]
CPU_MICRO_BATCH_TOKENS = 16384  # micro_batch_tokens' auto on a CPU
Switch = Literal["auto", "on", "off"]  # auto: the memory plan decides (true/false read as on/off)


def _valid(obj: Any, name: str, ok: bool, rule: str) -> None:
    """Knob `name` is refused unless `ok`; `rule` says what a valid value is."""
    check(ok, name, f"{rule}, got {getattr(obj, name)!r}")


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
    grad_clip: float = knob(1.0, "Gradient norm clipping.")
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
        8, "Most steps in one forward/backward (the gradient accumulation unit), packed in one row."
    )
    micro_batch_tokens: int = knob(
        0,
        "Most tokens (prompts and replies, image tokens included) in one forward/backward; a "
        "longer step trains alone. 0 (auto): on a GPU the most whole steps of the run's "
        "largest (at most micro_batch) that the memory plan fits (training.memory_plan); on a "
        "CPU 16,384, which holds micro_batch tiny-policy steps or one UI-TARS step of five "
        "1920x1080 screenshots.",
    )
    min_groups: int = knob(2, "Ready task groups needed before an update.")
    max_steps_per_update: int = knob(128, "Most steps trained in one update.")
    loss_type: LossType = knob("ppo", "Token-level PPO clipping or GSPO sequence ratio.")
    loss_aggregation: Aggregation = knob(
        "trajectory",
        "Every trajectory weighs the same, or DART's mean over all tokens (long episodes dominate).",
    )
    clip_low: float = knob(0.2, "PPO: the token ratio is clipped below at 1 - clip_low.")
    clip_high: float = knob(0.28, "PPO: the token ratio is clipped above at 1 + clip_high.")
    gspo_clip_low: float = knob(3e-4, "GSPO: the sequence ratio's lower clip range.")
    gspo_clip_high: float = knob(4e-4, "GSPO: the sequence ratio's upper clip range.")
    ppo_epochs: int = knob(1, "Passes over each batch (>1 lets the policy drift from pi_old).")
    mini_batches: int = knob(1, "Optimizer steps per pass (the batch split into this many).")
    kl_coef: float = knob(
        0.1,
        "KL to the initial policy (0 disables and frees the reference model; under LoRA the "
        "reference is the base with the adapters off, no second copy).",
    )
    bc_weight: float = knob(0.0, "Weight of the behaviour-cloning loss on experience-pool demos.")
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
    gradient_checkpointing: Switch = knob(
        "auto",
        "Recompute activations in the backward pass (less memory, about 30% more time). auto: "
        "on a GPU, on only when the memory plan needs it (training.memory_plan); off on a CPU.",
    )
    replicas: int = knob(
        0,
        "Data-parallel trainer processes, one per GPU. 0: auto: one, or under full fine-tuning "
        "on GPUs the fewest, sharded, whose memory plan fits the cluster's GPUs.",
    )
    shard: Switch = knob(
        "auto",
        "FSDP2: shard weights, gradients and AdamW state over the replicas (full FT). auto: on "
        "when the replicas' memory plan needs it (training.memory_plan).",
    )
    replica_timeout_s: float = knob(
        300.0,
        "How long a collective of the trainer's replicas may wait for a replica (a lost host "
        "ends the update after this, not NCCL's 10 minutes); size it above the longest "
        "micro-batch's forward and backward pass.",
    )

    def __post_init__(self) -> None:
        """The section's checks, one per rule, in the order of its fields: long because the
        rules are many, and one list reads against the fields above."""
        for name in ("gradient_checkpointing", "shard"):  # switches that were booleans
            if isinstance(getattr(self, name), bool):
                setattr(self, name, "on" if getattr(self, name) else "off")
        _valid(self, "lr", self.lr > 0, "must be > 0")
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
        check(
            0 <= self.replicas <= 64,
            "replicas",
            f"must be from 1 to 64, or 0 (auto), got {self.replicas}",
        )
        if self.replicas == 1:
            unused_knob(self, "replica_timeout_s", "with one replica (set replicas)")
        check(
            self.replica_timeout_s >= 10,
            "replica_timeout_s",
            f"must be >= 10 seconds, got {self.replica_timeout_s}",
        )
        if self.shard == "on":
            check(self.replicas != 1, "shard", "needs replicas > 1 (one shard per replica)")
            check(self.lora_rank == 0, "shard", "is for full fine-tuning (set lora_rank 0)")
        if self.lora_rank == 0:
            unused_knob(self, "lora_alpha", "under full fine-tuning (set lora_rank)")
            unused_knob(self, "lora_vision", "under full fine-tuning (set lora_rank)")
        else:
            check(self.lora_alpha > 0, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        _valid(self, "grad_clip", self.grad_clip > 0, "must be > 0")
        check(self.min_groups >= 1, "min_groups", "must be >= 1")
        check(self.max_steps_per_update >= 1, "max_steps_per_update", "must be >= 1")
        self._check_loss()
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

    def _check_loss(self) -> None:
        """The loss's knobs, in the order of their fields: what policy_update computes with."""
        _valid(self, "micro_batch", self.micro_batch >= 1, "must be >= 1")
        _valid(
            self,
            "micro_batch_tokens",
            self.micro_batch_tokens >= 0,
            "must be >= 0 (0: auto; a step longer than it still trains, alone)",
        )
        for name, choices in (("loss_type", LossType), ("loss_aggregation", Aggregation)):
            names = get_args(choices)
            _valid(self, name, getattr(self, name) in names, f"must be one of {', '.join(names)}")
        for name in ("clip_low", "clip_high", "gspo_clip_low", "gspo_clip_high"):
            value = getattr(self, name)
            if name.endswith("_low"):
                rule = f"must be in (0, 1) (the ratio's lower bound is 1 - {name})"
                _valid(self, name, 0 < value < 1, rule)
            else:
                _valid(
                    self, name, value > 0, f"must be > 0 (the ratio's upper bound is 1 + {name})"
                )
        for name in ("gradient_checkpointing", "shard"):
            _valid(self, name, getattr(self, name) in get_args(Switch), "must be auto, on or off")
        for name in ("ppo_epochs", "mini_batches"):
            _valid(self, name, getattr(self, name) >= 1, "must be >= 1")
        _valid(self, "kl_coef", self.kl_coef >= 0, "must be >= 0 (0 disables the KL)")
        _valid(
            self, "bc_weight", self.bc_weight >= 0, "must be >= 0 (0 disables behaviour cloning)"
        )

    @property
    def pg_clip(self) -> tuple[float, float]:
        """(low, high) clip range of the configured loss type."""
        if self.loss_type == "gspo":
            return self.gspo_clip_low, self.gspo_clip_high
        return self.clip_low, self.clip_high

    def lr_at(self, updates_done: int) -> float:
        """The learning rate of the next update, after `updates_done` updates (warm-start
        updates count): a linear warm-up to `lr`, then constant, or a cosine or linear decay to
        `lr * lr_min_ratio` over `lr_decay_updates` updates, held there afterwards."""
        n = updates_done + 1
        if n <= self.lr_warmup_updates:
            return self.lr * n / self.lr_warmup_updates
        if self.lr_schedule == "constant":
            return self.lr
        progress = min(1.0, (n - self.lr_warmup_updates - 1) / self.lr_decay_updates)
        shape = (
            (1 + math.cos(math.pi * progress)) / 2 if self.lr_schedule == "cosine" else 1 - progress
        )
        low = self.lr * self.lr_min_ratio
        return low + (self.lr - low) * shape

    def lora(self) -> LoraSpec | None:
        """The adapters the trainer adds, or None for full fine-tuning."""
        if self.lora_rank == 0:
            return None
        return LoraSpec(rank=self.lora_rank, alpha=self.lora_alpha, vision=self.lora_vision)


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
    entropy_top_q: float = knob(0.8, "Fraction of steps kept by the entropy filter.")
    entropy_recenter: bool = knob(
        True,
        "Re-centre the kept steps' advantages per group (the filter favours failures).",
    )
    truncated_is: bool = knob(True, "Truncated importance sampling for rollout/trainer mismatch.")
    is_cap: float = knob(1.0, "Truncation C of the IS weight.")
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
        q = self.entropy_top_q
        _valid(self, "entropy_top_q", 0 < q <= 1, "must be in (0, 1] (1.0 keeps every step)")
        _valid(self, "is_cap", self.is_cap > 0, "must be > 0 (DART uses 1.0)")
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

    @property
    def entropy_q(self) -> float:
        """The share of steps the entropy filter keeps: entropy_top_q, or every step (1.0)
        with high_entropy off."""
        return self.entropy_top_q if self.high_entropy else 1.0


# Where the trainer's leader (rank 0, in the run's train worker) listens for replicas that
# join from other hosts, as host:port (`hostagent.cluster`); unset, its replicas are its own
# children on its host.
RENDEZVOUS_ENV = "DARTBOARD_TRAINER_RENDEZVOUS"
# The trainer's replicas and whether they shard, as the run's placement decided them where
# `trainer.replicas` or `trainer.shard` is auto (`training.memory_plan.trainer_layout`).
REPLICAS_ENV = "DARTBOARD_TRAINER_REPLICAS"
SHARD_ENV = "DARTBOARD_TRAINER_SHARD"
