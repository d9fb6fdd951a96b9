"""Run configuration: typed dataclasses, one line of help per field, validated on creation.

The resolved config (every default filled in) is stored on the Run row as JSON, so a run can
be reproduced from the database alone. `RunConfig.from_dict` reports every bad value at once,
each with its exact field path ("trainer.lr: must be > 0, got -1.0"), as `ConfigInvalid`; the
run form shows each message next to its field, the API returns them all.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

from datamanager.curation import INSTANCE_SEED_BASE
from datamanager.models import EnvKind
from training.ranges import UPDATE_DEFAULTS, Aggregation, LossType, range_error

# UI-TARS-1.5's replies and screenshots (`rollout.prompt` ui-tars-1.5): a Thought and an
# Action run to hundreds of tokens; a 1920x1080 screenshot is 2,691 prompt tokens.
UI_TARS_MIN_NEW_TOKENS = 256
UI_TARS_MIN_PROMPT_TOKENS = 16384


class ConfigError(ValueError):
    """A config value is invalid. `path` is the dotted field name, e.g. 'trainer.lr'."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


class ConfigInvalid(ConfigError):
    """Every problem of a config, in the order of its fields (`problems`); `path` and
    `message` are the first one's, so a caller that shows one problem shows that."""

    def __init__(self, problems: list[ConfigError]) -> None:
        ValueError.__init__(self, "; ".join(str(p) for p in problems))
        self.path = problems[0].path
        self.message = problems[0].message
        self.problems = problems


# The problems `RunConfig.from_dict` collects while it builds a config (None outside it: a
# check raises at once, as when a dataclass is built in code).
_collected: ContextVar[list[ConfigError] | None] = ContextVar("config_problems", default=None)


def _problem(error: ConfigError) -> None:
    collected = _collected.get()
    if collected is None:
        raise error
    collected.append(error)


def knob(default: Any, help: str) -> Any:  # noqa: A002  (help text, not builtins.help)
    """A config field with its one-line help (shown in the run form)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _unused_knob(obj: Any, name: str, why: str) -> None:
    """A knob set away from its default where it does nothing is an error, not a silent no-op."""
    default = next(f.default for f in dataclasses.fields(obj) if f.name == name)
    _check(getattr(obj, name) == default, name, f"has no effect {why}; leave it at {default}")


def _check(cond: bool, path: str, message: str) -> None:
    if not cond:
        _problem(ConfigError(path, message))


def _in_update_range(obj: Any, name: str, knob: str = "") -> None:
    """Knob `name` becomes the update's `knob` (default: the same name): it is refused with that
    knob's range and message (training.ranges), under its own name."""
    message = range_error(knob or name, getattr(obj, name), name=name)
    _check(message is None, name, message or "")


@dataclass
class TaskSelection:
    split: Literal["train", "eval"] = knob("train", "Which split's tasks the run trains on.")
    tags: list[str] = knob([], "Only tasks with all of these tags (empty: no tag filter).")
    names: list[str] = knob([], "Only these task names (empty: every task of the split/tags).")
    env_kinds: list[str] = knob(
        ["miniwob"],
        "Environment backends whose tasks are included: miniwob, desktop, sim, osworld.",
    )
    instances: int = knob(
        0,
        "Fixed training instances per task (seeds a task's groups cycle through, like "
        "OSWorld's fixed tasks); 0: every group starts from a new seed.",
    )

    def __post_init__(self) -> None:
        bad = sorted(set(self.env_kinds) - set(EnvKind.values))
        _check(not bad, "env_kinds", f"unknown backend(s) {bad}; use {', '.join(EnvKind.values)}")
        _check(bool(self.env_kinds), "env_kinds", "name at least one backend")
        _check(0 <= self.instances <= 1000, "instances", "must be between 0 and 1000")


@dataclass
class EnvConfig:
    miniwob_slots: int = knob(2, "MiniWoB++ browser slots (one chromium each).")
    desktop_slots: int = knob(0, "Xvfb desktop slots.")
    sim_slots: int = knob(
        0, "Simulated slots (envmanager/sim_env.py): synthetic screens, no browser; load tests."
    )
    osworld_addresses: list[str] = knob(
        [],
        "OSWorld VMs (or Dartboard desktops serving OSWorld's protocol) as host:port, one "
        "osworld slot each; a task whose env_config names an 'address' uses that VM instead.",
    )
    osworld_provider: str = knob(
        "",
        "desktop_env provider that reverts the VMs to a snapshot before each task (vmware, "
        "virtualbox, docker, aws, azure, aliyun, volcengine); empty: Dartboard desktops, "
        "reset by their /dartboard/reset.",
    )
    osworld_vm_paths: list[str] = knob(
        [], "The provider's VM path or id of each address, in the same order (with a provider)."
    )
    osworld_snapshot: str = knob("init_state", "Snapshot the provider reverts each VM to.")
    osworld_region: str = knob("", "The provider's region (cloud providers).")
    step_timeout_s: float = knob(30.0, "A reset/step taking longer ends the episode as error.")
    heartbeat_s: float = knob(5.0, "Slot heartbeat period.")
    quarantine_after: int = knob(3, "Consecutive failures before a slot is quarantined.")
    error_rate_alert: float = knob(
        0.25,
        "Alert on the run page when a host's or a task's share of rollouts ending in an "
        "environment error over the last 15 minutes exceeds this (0: off; 5 rollouts at least).",
    )

    def __post_init__(self) -> None:
        _check(0 <= self.miniwob_slots <= 64, "miniwob_slots", "must be between 0 and 64")
        _check(0 <= self.desktop_slots <= 16, "desktop_slots", "must be between 0 and 16")
        _check(0 <= self.sim_slots <= 10_000, "sim_slots", "must be between 0 and 10000")
        _check(
            self.miniwob_slots + self.desktop_slots + self.sim_slots + len(self.osworld_addresses)
            > 0,
            "miniwob_slots",
            "a run needs at least one slot",
        )
        self._check_osworld()
        _check(self.step_timeout_s > 0, "step_timeout_s", "must be > 0")
        _check(self.heartbeat_s > 0, "heartbeat_s", "must be > 0")
        _check(self.quarantine_after >= 1, "quarantine_after", "must be >= 1")
        _check(
            0 <= self.error_rate_alert <= 1,
            "error_rate_alert",
            f"must be a share from 0 to 1 (0 turns it off), got {self.error_rate_alert}",
        )

    def _check_osworld(self) -> None:
        _check(len(self.osworld_addresses) <= 256, "osworld_addresses", "at most 256 VMs")
        for address in self.osworld_addresses:
            host, sep, port = address.rpartition(":")
            _check(
                bool(sep and host) and port.isdigit() and 0 < int(port) < 65536
                and "@" not in host and "/" not in host,
                "osworld_addresses",
                f"{address!r} is not host:port (e.g. 10.0.0.5:5000)",
            )  # fmt: skip
        _check(
            len(set(self.osworld_addresses)) == len(self.osworld_addresses),
            "osworld_addresses",
            "an address appears twice (one slot per VM)",
        )
        providers = ("vmware", "virtualbox", "docker", "aws", "azure", "aliyun", "volcengine")
        _check(
            self.osworld_provider in ("", *providers),
            "osworld_provider",
            f"unknown provider {self.osworld_provider!r}; use one of {', '.join(providers)}",
        )
        if self.osworld_provider:
            _check(
                len(self.osworld_vm_paths) == len(self.osworld_addresses),
                "osworld_vm_paths",
                f"give one VM path per address ({len(self.osworld_addresses)})",
            )
            _check(bool(self.osworld_snapshot.strip()), "osworld_snapshot", "name a snapshot")
        else:
            _check(
                not self.osworld_vm_paths,
                "osworld_vm_paths",
                "has no effect without an osworld_provider; leave it empty",
            )
            _unused_knob(self, "osworld_region", "without an osworld_provider")

    def slots(self) -> list[tuple[str, int]]:
        """Every env slot of a run as (backend, index), in the order workers start them."""
        return (
            [("miniwob", i) for i in range(self.miniwob_slots)]
            + [("desktop", i) for i in range(self.desktop_slots)]
            + [("sim", i) for i in range(self.sim_slots)]
            + [("osworld", i) for i in range(len(self.osworld_addresses))]
        )

    @property
    def silent_after_s(self) -> float:
        """A slot silent this long has lost its worker: its episode is ended as `aborted`
        and its tile shows `lost` (three missed heartbeats plus slack for a busy machine)."""
        return 3 * self.heartbeat_s + 10


@dataclass
class RolloutConfig:
    max_images: int = knob(5, "Screenshots kept in the prompt (the last K).")
    max_prompt_tokens: int = knob(4096, "Token budget of a prompt; oldest text turns drop first.")
    max_new_tokens: int = knob(64, "Tokens the policy may generate per step.")
    temperature: float = knob(1.0, "Sampling temperature for training rollouts.")
    top_p: float = knob(1.0, "Nucleus sampling for training rollouts.")
    max_parse_errors: int = knob(3, "Consecutive unparsable outputs that end an episode as failed.")
    request_timeout_s: float = knob(
        60.0, "An episode with no policy answer in this time ends as error."
    )
    inference_workers: int = knob(
        1, "Inference workers the host agent starts for the run (one GPU each, or CPU slots)."
    )
    backend: Literal["transformers", "vllm"] = knob(
        "transformers",
        "Inference workers: Dartboard's transformers server (CPU or GPU) or vLLM behind its "
        "adapter (GPU hosts with requirements-gpu.txt).",
    )
    vllm_gpus: Literal["after_trainer", "shared"] = knob(
        "after_trainer",
        "Where vLLM workers run on a GPU host: on the GPUs after the trainer's (worker i on "
        "GPU trainer.replicas + i), or shared with the trainer (worker i on GPU i, with "
        "vllm_gpu_memory at most 0.5 so both fit).",
    )
    vllm_gpu_memory: float = knob(
        0.9, "Fraction of its GPU's memory vLLM takes for weights and KV cache (vLLM's own)."
    )
    prompt: Literal["dartboard", "ui-tars-1.5"] = knob(
        "dartboard",
        "Prompt template: Dartboard's (the shipped tiny policy's) or UI-TARS-1.5's computer-use "
        "template (for UI-TARS / Qwen2.5-VL checkpoints).",
    )
    coords: Literal["pixel", "relative1000"] = knob(
        "pixel",
        "Coordinates the model writes: pixels of the processor-resized screenshot (UI-TARS-1.5, "
        "Qwen2.5-VL) or 0-999 fractions of the screen (UI-TARS-1.0, Qwen2-VL).",
    )
    language: str = knob("English", "UI-TARS-1.5 prompt: the language of the Thought part.")

    def __post_init__(self) -> None:
        if self.prompt != "ui-tars-1.5":
            _unused_knob(self, "language", "outside the ui-tars-1.5 prompt")
        else:  # sized for the tiny policy, these defaults would cut every UI-TARS turn short
            _check(
                self.max_new_tokens >= UI_TARS_MIN_NEW_TOKENS,
                "max_new_tokens",
                f"UI-TARS-1.5 writes a Thought before each Action, hundreds of tokens: give it "
                f"at least {UI_TARS_MIN_NEW_TOKENS} (got {self.max_new_tokens})",
            )
            _check(
                self.max_prompt_tokens >= UI_TARS_MIN_PROMPT_TOKENS,
                "max_prompt_tokens",
                f"one 1920x1080 screenshot is 2,691 tokens for UI-TARS-1.5: "
                f"{self.max_images} of them and the history need at least "
                f"{UI_TARS_MIN_PROMPT_TOKENS} (got {self.max_prompt_tokens})",
            )
        _check(
            bool(self.language.strip()) and len(self.language) <= 40,
            "language",
            "must be a language name of at most 40 characters",
        )
        _check(1 <= self.max_images <= 32, "max_images", "must be between 1 and 32")
        _check(self.max_prompt_tokens >= 256, "max_prompt_tokens", "must be >= 256")
        _check(1 <= self.max_new_tokens <= 4096, "max_new_tokens", "must be between 1 and 4096")
        _check(
            self.temperature > 0, "temperature", "must be > 0 (use evaluation for greedy decoding)"
        )
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.max_parse_errors >= 1, "max_parse_errors", "must be >= 1")
        _check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        _check(1 <= self.inference_workers <= 16, "inference_workers", "must be between 1 and 16")
        _check(0 < self.vllm_gpu_memory <= 0.95, "vllm_gpu_memory", "must be in (0, 0.95]")


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
        _in_update_range(self, "lr")
        _check(
            self.lr_warmup_updates >= 0,
            "lr_warmup_updates",
            f"must be >= 0, got {self.lr_warmup_updates}",
        )
        _check(
            self.pool_mix_steps >= 0, "pool_mix_steps", f"must be >= 0, got {self.pool_mix_steps}"
        )
        _check(
            self.pool_mix_steps == 0 or self.bc_weight > 0,
            "pool_mix_steps",
            "needs bc_weight > 0: mixed-in demos train only through the behaviour-cloning term",
        )
        if self.lr_schedule == "constant":
            _unused_knob(self, "lr_decay_updates", "under a constant lr_schedule")
            _unused_knob(self, "lr_min_ratio", "under a constant lr_schedule")
        _check(
            self.lr_decay_updates > 0 or self.lr_schedule == "constant",
            "lr_decay_updates",
            f"a {self.lr_schedule} schedule needs the updates it decays over (> 0), "
            f"got {self.lr_decay_updates}",
        )
        _check(
            0 < self.lr_min_ratio <= 1,
            "lr_min_ratio",
            f"must be in (0, 1] (a zero rate would stop training), got {self.lr_min_ratio}",
        )
        _check(
            self.stale_serving_alert >= 0,
            "stale_serving_alert",
            f"must be >= 0 (0 turns it off), got {self.stale_serving_alert}",
        )
        _check(
            self.logprob_gap_alert >= 0,
            "logprob_gap_alert",
            f"must be >= 0 (0 turns it off), got {self.logprob_gap_alert}",
        )
        _check(
            0 <= self.left_out_alert <= 1,
            "left_out_alert",
            f"must be a share from 0 to 1 (0 turns it off), got {self.left_out_alert}",
        )
        _check(self.lora_rank >= 0, "lora_rank", f"must be >= 0, got {self.lora_rank}")
        _check(1 <= self.replicas <= 64, "replicas", f"must be from 1 to 64, got {self.replicas}")
        if self.shard:
            _check(self.replicas > 1, "shard", "needs replicas > 1 (one shard per replica)")
            _check(self.lora_rank == 0, "shard", "is for full fine-tuning (set lora_rank 0)")
        if self.lora_rank == 0:
            _unused_knob(self, "lora_alpha", "under full fine-tuning (set lora_rank)")
            _unused_knob(self, "lora_vision", "under full fine-tuning (set lora_rank)")
        else:
            _check(self.lora_alpha > 0, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        _check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        _in_update_range(self, "grad_clip", "max_grad_norm")
        _check(self.min_groups >= 1, "min_groups", "must be >= 1")
        _check(self.max_steps_per_update >= 1, "max_steps_per_update", "must be >= 1")
        for name in ("micro_batch", "clip_low", "clip_high", "gspo_clip_low", "gspo_clip_high",
                     "ppo_epochs", "mini_batches", "kl_coef", "bc_weight"):  # fmt: skip
            _in_update_range(self, name)
        if self.loss_type == "gspo":
            _unused_knob(self, "clip_low", "under loss_type gspo (set gspo_clip_low)")
            _unused_knob(self, "clip_high", "under loss_type gspo (set gspo_clip_high)")
        else:
            _unused_knob(self, "gspo_clip_low", "under loss_type ppo (set clip_low)")
            _unused_knob(self, "gspo_clip_high", "under loss_type ppo (set clip_high)")
        _check(self.warm_start_bc_updates >= 0, "warm_start_bc_updates", "must be >= 0")
        _check(self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
        _check(
            self.optimizer_states_kept >= 1,
            "optimizer_states_kept",
            f"must be >= 1 (the newest version's state is what a restarted trainer resumes "
            f"from), got {self.optimizer_states_kept}",
        )
        _check(self.versions_kept >= 0, "versions_kept", f"must be >= 0, got {self.versions_kept}")
        _check(
            self.versions_kept == 0 or self.versions_kept >= self.optimizer_states_kept,
            "versions_kept",
            f"keeps fewer versions ({self.versions_kept}) than optimizer_states_kept "
            f"({self.optimizer_states_kept}): a version's state is useless without its weights",
        )
        _check(
            self.versions_keep_every >= 0,
            "versions_keep_every",
            f"must be >= 0, got {self.versions_keep_every}",
        )
        if self.versions_kept == 0:
            _unused_knob(
                self, "versions_keep_every", "while versions_kept is 0 (every version is kept)"
            )
        _check(self.max_updates >= 0, "max_updates", "must be >= 0")


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
    # 2 holds at one update in training and one waiting: 0.4% of steps stale instead of
    # a quarter, as many trained a minute, but it learned less in the main job's measured
    # seeds (docs/benchmarks.md, *Backpressure on the main job*), so it is off by default.
    backpressure: float = knob(
        0.0,
        "Hold new training claims while ready, untrained steps fill this many updates "
        "(trainer.max_steps_per_update each); 0: never hold.",
    )
    success_window: int = knob(16, "Trajectories in a task's rolling success rate.")
    error_retries: int = knob(
        2,
        "A group member that ends in an environment error is replaced by a new rollout on a "
        "fresh environment, up to this many times per group; a group still missing a member "
        "is dropped (skipped, with the error), never trained without it.",
    )

    def __post_init__(self) -> None:
        _check(1 <= self.n_min <= self.n_max, "n_min", "must satisfy 1 <= n_min <= n_max")
        _check(self.n_max <= 64, "n_max", "must be <= 64")
        _check(0 < self.budget_threshold <= 1, "budget_threshold", "must be in (0, 1]")
        _check(self.default_step_cap >= 1, "default_step_cap", "must be >= 1")
        _check(self.step_cap_margin >= 0, "step_cap_margin", "must be >= 0")
        _check(0 <= self.pool_ratio <= 1, "pool_ratio", "must be in [0, 1]")
        _in_update_range(self, "entropy_top_q")
        _in_update_range(self, "is_cap")
        _check(self.staleness_k >= 0, "staleness_k", "must be >= 0")
        _check(self.max_uses_per_step >= 1, "max_uses_per_step", "must be >= 1")
        _check(0 <= self.backpressure <= 100, "backpressure", "must be between 0 and 100")
        _check(self.success_window >= 1, "success_window", "must be >= 1")
        _check(0 <= self.error_retries <= 8, "error_retries", "must be between 0 and 8")
        if not self.truncated_is:
            _unused_knob(self, "is_cap", "with truncated_is off")
        if not self.high_entropy:
            _unused_knob(self, "entropy_top_q", "with high_entropy off")
            _unused_knob(self, "entropy_recenter", "with high_entropy off")
        if not self.experience_pool:
            _unused_knob(self, "pool_ratio", "with experience_pool off")
        if not self.dynamic_step_cap:
            _unused_knob(self, "step_cap_margin", "with dynamic_step_cap off")
        if not self.dynamic_budget:
            _unused_knob(self, "n_min", "with dynamic_budget off (every task gets n_max)")
            _unused_knob(self, "budget_threshold", "with dynamic_budget off")


@dataclass
class EvaluationConfig:
    every_n_versions: int = knob(
        0,
        "Scheduled evaluation of every N-th policy version (0: off). One runs at a time; when "
        "it ends, the newest version due is next and those published meanwhile are skipped.",
    )
    k: int = knob(1, "Episodes per eval task (fixed seeds).")
    slot_share: float = knob(
        0.5,
        "Share of the run's env slots a scheduled evaluation runs on (at least one slot): they "
        "hand over to it between episodes, the others keep training.",
    )
    greedy: bool = knob(True, "Greedy decoding in scheduled evaluations.")
    eval_split: bool = knob(
        True, "Evaluate each scheduled version on the eval split of the run's env kinds."
    )
    train_instances: bool = knob(
        False,
        "Also evaluate each scheduled version on the run's training instances (its tasks at "
        "the seeds of tasks.instances): the run page charts it per version.",
    )
    train_instances_k: int = knob(
        0,
        "Evaluate the first K of each task's training instances (0: all tasks.instances), so a "
        "run with many instances is still charted at a bounded cost.",
    )
    heldout_k: int = knob(
        0,
        "Also evaluate each scheduled version on this many held-out seeds per training task, "
        "seeds the run never trains on (0: off): the run page charts it beside the training "
        "instances.",
    )
    heldout_seed: int = knob(777, "Held-out seeds are heldout_seed * 1000 + i, i < heldout_k.")

    def __post_init__(self) -> None:
        _check(self.every_n_versions >= 0, "every_n_versions", "must be >= 0")
        _check(1 <= self.k <= 64, "k", "must be between 1 and 64")
        _check(0 < self.slot_share <= 1, "slot_share", "must be in (0, 1]")
        _check(0 <= self.heldout_k <= 64, "heldout_k", "must be between 0 and 64")
        _check(0 <= self.train_instances_k <= 64, "train_instances_k", "must be between 0 and 64")
        if not self.train_instances:
            _unused_knob(self, "train_instances_k", "with train_instances off")
        _check(self.heldout_seed >= 0, "heldout_seed", "must be >= 0")


@dataclass
class RunConfig:
    mode: Literal["decoupled", "synchronous"] = knob(
        "decoupled", "DART's asynchronous design, or the synchronous batch-loop baseline."
    )
    sync_lockstep: bool = knob(
        True,
        "Synchronous mode: a round's episodes take their turns together (a batch step loop), "
        "or run freely with only the round's end as the barrier.",
    )
    policy: str = knob(
        "shipped",
        "Starting checkpoint: 'shipped', 'shipped-desktop' (pretrained on desktops too), "
        "'untrained', a local HF directory, or an artifact "
        "reference (artifact:policies/...@sha256, from manage.py publish_policy) that every "
        "host fetches.",
    )
    seed: int = knob(0, "Seed of task sampling and decoding.")
    device: Literal["auto", "cpu", "cuda"] = knob(
        "auto",
        "Where a host agent puts the run's trainer and inference workers: auto (GPUs where the "
        "host has them, else the CPU), cpu, or cuda (the run waits for a host with free GPUs).",
    )
    tasks: TaskSelection = field(default_factory=TaskSelection)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    curation: CurationConfig = field(default_factory=CurationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)

    def __post_init__(self) -> None:
        _check(bool(self.policy.strip()), "policy", "name a checkpoint")
        _check(
            self.rollout.backend != "vllm" or not self.trainer.lora_vision,
            "trainer.lora_vision",
            "vLLM serves LoRA adapters on the language model only: its rollouts would ignore "
            "the vision tower's adapters the trainer learns (use the transformers backend, or "
            "keep the vision tower frozen)",
        )
        _check(
            self.rollout.backend != "vllm"
            or self.rollout.vllm_gpus != "shared"
            or self.rollout.vllm_gpu_memory <= 0.5,
            "rollout.vllm_gpu_memory",
            f"vLLM shares its GPU with the trainer (rollout.vllm_gpus shared) but would take "
            f"{self.rollout.vllm_gpu_memory:.0%} of it: the trainer runs out of memory; give "
            "vLLM 0.5 or less, or put it after the trainer's GPUs (vllm_gpus after_trainer)",
        )
        _check(
            not self.evaluation.train_instances or self.tasks.instances > 0,
            "evaluation.train_instances",
            "the run has no fixed training instances: set tasks.instances (e.g. 10) or turn it off",
        )
        _check(
            self.evaluation.train_instances_k <= self.tasks.instances,
            "evaluation.train_instances_k",
            f"the run has {self.tasks.instances} training instances per task; "
            f"got {self.evaluation.train_instances_k}",
        )
        _check(
            self.evaluation.heldout_seed != INSTANCE_SEED_BASE + self.seed,
            "evaluation.heldout_seed",
            f"{self.evaluation.heldout_seed} gives the training instances' seeds; choose another",
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RunConfig:
        """Build and validate from (partial) JSON; missing fields take their defaults. Raises
        ConfigInvalid with every problem: a value of the wrong type or an unknown setting is
        left out (its default stands in) so the checks of the rest still run."""
        problems: list[ConfigError] = []
        token = _collected.set(problems)
        try:
            config = _build(cls, data or {}, "")
        finally:
            _collected.reset(token)
        if problems:
            raise ConfigInvalid(problems)
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_override(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of config JSON `data` with the setting at dotted `path` ("trainer.lr") set to
    `value`: how a copy, `--set` and a sweep's grid change one setting. Whether the path and
    the value are valid is `from_dict`'s to say."""
    out = dict(data)
    head, _, rest = path.partition(".")
    if not rest:
        out[head] = value
        return out
    inner = out.get(head)
    out[head] = config_override(inner if isinstance(inner, dict) else {}, rest, value)
    return out


def _build(cls: type, data: Any, prefix: str) -> Any:
    """An instance of dataclass `cls` from `data`, its problems reported (`_problem`) with
    `prefix` before their paths; None when `data` is not an object at all."""
    if not isinstance(data, dict):
        _problem(ConfigError(prefix.rstrip("."), f"must be an object, got {type(data).__name__}"))
        return None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for name in sorted(set(data) - names, key=str):
        _problem(
            ConfigError(prefix + str(name), f"unknown setting (known: {', '.join(sorted(names))})")
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        try:
            value = _coerce(hints[f.name], data[f.name], prefix + f.name)
        except ConfigError as exc:
            _problem(exc)
            continue
        if value is not None:
            kwargs[f.name] = value
    collected = _collected.get()
    before = len(collected) if collected is not None else 0
    try:
        built = cls(**kwargs)
    except ConfigError as exc:  # raised at once: built outside `from_dict`
        if exc.path.startswith(prefix) and prefix:
            raise
        raise ConfigError(prefix + exc.path, exc.message) from None
    if collected is not None and prefix:  # this class's own checks name its fields only
        for i in range(before, len(collected)):
            problem = collected[i]
            collected[i] = ConfigError(prefix + problem.path, problem.message)
    return built


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, path + ".")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(path, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin in (list, types.GenericAlias) or tp is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(path, f"must be a list of strings, got {value!r}")
        return list(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    raise ConfigError(path, f"unsupported type {tp!r}")  # a programming error in this module
