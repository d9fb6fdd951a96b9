"""Run configuration: typed dataclasses, one line of help per field, validated on creation.

How a field is declared, parsed and checked is `core.config_fields`'s; the trainer's and
curation's sections are `training.config`'s, which the trainer takes as they are.

The resolved config (every default filled in) is stored on the Run row as JSON, so a run can
be reproduced from the database alone. `RunConfig.from_dict` reports every bad value at once,
each with its exact field path ("trainer.lr: must be > 0, got -1.0"), as `ConfigInvalid`; the
run form shows each message next to its field, the API returns them all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from django.db import models

from core.config_fields import (
    ConfigError,
    ConfigInvalid,
    build_all,
    check,
    config_override,
    knob,
    unused_knob,
)
from datamanager.curation import INSTANCE_SEED_BASE
from envmanager.osworld_needs import CAPABILITIES, OSWORLD_VM_OFFERS
from rollout.limits import VLLM_LORA_RANKS
from training.config import CurationConfig, TrainerConfig

__all__ = [
    "ConfigError",
    "ConfigInvalid",
    "CurationConfig",
    "EnvConfig",
    "EnvKind",
    "EvaluationConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskSelection",
    "TrainerConfig",
    "config_override",
]


class EnvKind(models.TextChoices):
    """The env backends a task runs on and a run's `tasks.env_kinds` names (the Task table's
    choices, `datamanager.models` re-exports it): here, so the models can parse a run's
    settings without importing back into them."""

    MINIWOB = "miniwob"
    DESKTOP = "desktop"
    SIM = "sim"
    OSWORLD = "osworld"


# UI-TARS-1.5's replies and screenshots (`rollout.prompt` ui-tars-1.5): a Thought and an
# Action run to hundreds of tokens; a 1920x1080 screenshot is 2,691 prompt tokens.
UI_TARS_MIN_NEW_TOKENS = 256
UI_TARS_MIN_PROMPT_TOKENS = 16384


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
        check(not bad, "env_kinds", f"unknown backend(s) {bad}; use {', '.join(EnvKind.values)}")
        check(bool(self.env_kinds), "env_kinds", "name at least one backend")
        check(0 <= self.instances <= 1000, "instances", "must be between 0 and 1000")


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
    osworld_offers: list[str] = knob(
        list(OSWORLD_VM_OFFERS),
        "What the run's OSWorld VMs offer the tasks (envmanager.osworld_needs): apps "
        "(app:chrome, ...), chrome_cdp, accessibility_tree, vlc_http; add internet, "
        "google_drive or worker_internet only where the VMs and workers really have them. "
        "A run whose tasks need more is refused at create.",
    )
    step_timeout_s: float = knob(30.0, "A reset/step taking longer ends the episode as error.")
    heartbeat_s: float = knob(5.0, "Slot heartbeat period.")
    quarantine_after: int = knob(3, "Consecutive failures before a slot is quarantined.")
    error_rate_alert: float = knob(
        0.25,
        "Alert on the run page when a host's or a task's share of rollouts ending in an "
        "environment error over the last 15 minutes exceeds this (0: off; 5 rollouts at least).",
    )

    def __post_init__(self) -> None:
        check(0 <= self.miniwob_slots <= 64, "miniwob_slots", "must be between 0 and 64")
        check(0 <= self.desktop_slots <= 16, "desktop_slots", "must be between 0 and 16")
        check(0 <= self.sim_slots <= 10_000, "sim_slots", "must be between 0 and 10000")
        check(
            self.miniwob_slots + self.desktop_slots + self.sim_slots + len(self.osworld_addresses)
            > 0,
            "miniwob_slots",
            "a run needs at least one slot",
        )
        self._check_osworld()
        check(self.step_timeout_s > 0, "step_timeout_s", "must be > 0")
        check(self.heartbeat_s > 0, "heartbeat_s", "must be > 0")
        check(self.quarantine_after >= 1, "quarantine_after", "must be >= 1")
        check(
            0 <= self.error_rate_alert <= 1,
            "error_rate_alert",
            f"must be a share from 0 to 1 (0 turns it off), got {self.error_rate_alert}",
        )

    def _check_osworld(self) -> None:
        check(len(self.osworld_addresses) <= 256, "osworld_addresses", "at most 256 VMs")
        unknown = sorted(set(self.osworld_offers) - set(CAPABILITIES))
        check(not unknown, "osworld_offers", f"unknown {unknown}; use {', '.join(CAPABILITIES)}")
        if not self.osworld_addresses:
            unused_knob(self, "osworld_offers", "without osworld_addresses")
        for address in self.osworld_addresses:
            host, sep, port = address.rpartition(":")
            check(
                bool(sep and host)
                and port.isdigit()
                and 0 < int(port) < 65536
                and "@" not in host
                and "/" not in host,
                "osworld_addresses",
                f"{address!r} is not host:port (e.g. 10.0.0.5:5000)",
            )
        check(
            len(set(self.osworld_addresses)) == len(self.osworld_addresses),
            "osworld_addresses",
            "an address appears twice (one slot per VM)",
        )
        providers = ("vmware", "virtualbox", "docker", "aws", "azure", "aliyun", "volcengine")
        check(
            self.osworld_provider in ("", *providers),
            "osworld_provider",
            f"unknown provider {self.osworld_provider!r}; use one of {', '.join(providers)}",
        )
        if self.osworld_provider:
            check(
                len(self.osworld_vm_paths) == len(self.osworld_addresses),
                "osworld_vm_paths",
                f"give one VM path per address ({len(self.osworld_addresses)})",
            )
            check(bool(self.osworld_snapshot.strip()), "osworld_snapshot", "name a snapshot")
        else:
            check(
                not self.osworld_vm_paths,
                "osworld_vm_paths",
                "has no effect without an osworld_provider; leave it empty",
            )
            unused_knob(self, "osworld_region", "without an osworld_provider")

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
    max_prompt_tokens: int = knob(
        4096,
        "Token budget of a prompt, counted by the policy's tokenizer and processor; past it the "
        "oldest screenshots drop first, then the oldest text turns.",
    )
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
            unused_knob(self, "language", "outside the ui-tars-1.5 prompt")
        else:  # sized for the tiny policy, these defaults would cut every UI-TARS turn short
            check(
                self.max_new_tokens >= UI_TARS_MIN_NEW_TOKENS,
                "max_new_tokens",
                f"UI-TARS-1.5 writes a Thought before each Action, hundreds of tokens: give it "
                f"at least {UI_TARS_MIN_NEW_TOKENS} (got {self.max_new_tokens})",
            )
            check(
                self.max_prompt_tokens >= UI_TARS_MIN_PROMPT_TOKENS,
                "max_prompt_tokens",
                f"one 1920x1080 screenshot is 2,691 tokens for UI-TARS-1.5: "
                f"{self.max_images} of them and the history need at least "
                f"{UI_TARS_MIN_PROMPT_TOKENS} (got {self.max_prompt_tokens})",
            )
        check(
            bool(self.language.strip()) and len(self.language) <= 40,
            "language",
            "must be a language name of at most 40 characters",
        )
        check(1 <= self.max_images <= 32, "max_images", "must be between 1 and 32")
        check(self.max_prompt_tokens >= 256, "max_prompt_tokens", "must be >= 256")
        check(1 <= self.max_new_tokens <= 4096, "max_new_tokens", "must be between 1 and 4096")
        check(
            self.temperature > 0, "temperature", "must be > 0 (use evaluation for greedy decoding)"
        )
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.max_parse_errors >= 1, "max_parse_errors", "must be >= 1")
        check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        check(1 <= self.inference_workers <= 16, "inference_workers", "must be between 1 and 16")
        check(0 < self.vllm_gpu_memory <= 0.95, "vllm_gpu_memory", "must be in (0, 0.95]")


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
        check(self.every_n_versions >= 0, "every_n_versions", "must be >= 0")
        check(1 <= self.k <= 64, "k", "must be between 1 and 64")
        check(0 < self.slot_share <= 1, "slot_share", "must be in (0, 1]")
        check(0 <= self.heldout_k <= 64, "heldout_k", "must be between 0 and 64")
        check(0 <= self.train_instances_k <= 64, "train_instances_k", "must be between 0 and 64")
        if not self.train_instances:
            unused_knob(self, "train_instances_k", "with train_instances off")
        check(self.heldout_seed >= 0, "heldout_seed", "must be >= 0")


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
        check(bool(self.policy.strip()), "policy", "name a checkpoint")
        check(
            self.rollout.backend != "vllm" or not self.trainer.lora_vision,
            "trainer.lora_vision",
            "vLLM serves LoRA adapters on the language model only: its rollouts would ignore "
            "the vision tower's adapters the trainer learns (use the transformers backend, or "
            "keep the vision tower frozen)",
        )
        check(
            self.rollout.backend != "vllm" or self.trainer.lora_rank <= VLLM_LORA_RANKS[-1],
            "trainer.lora_rank",
            f"vLLM serves LoRA adapters of rank up to {VLLM_LORA_RANKS[-1]}, got "
            f"{self.trainer.lora_rank} (use a smaller rank, or the transformers backend)",
        )
        check(
            self.rollout.backend != "vllm"
            or self.rollout.vllm_gpus != "shared"
            or self.rollout.vllm_gpu_memory <= 0.5,
            "rollout.vllm_gpu_memory",
            f"vLLM shares its GPU with the trainer (rollout.vllm_gpus shared) but would take "
            f"{self.rollout.vllm_gpu_memory:.0%} of it: the trainer runs out of memory; give "
            "vLLM 0.5 or less, or put it after the trainer's GPUs (vllm_gpus after_trainer)",
        )
        check(
            not self.evaluation.train_instances or self.tasks.instances > 0,
            "evaluation.train_instances",
            "the run has no fixed training instances: set tasks.instances (e.g. 10) or turn it off",
        )
        check(
            self.evaluation.train_instances_k <= self.tasks.instances,
            "evaluation.train_instances_k",
            f"the run has {self.tasks.instances} training instances per task; "
            f"got {self.evaluation.train_instances_k}",
        )
        check(
            self.evaluation.heldout_seed != INSTANCE_SEED_BASE + self.seed,
            "evaluation.heldout_seed",
            f"{self.evaluation.heldout_seed} gives the training instances' seeds; choose another",
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RunConfig:
        """Build and validate from (partial) JSON; missing fields take their defaults. Raises
        ConfigInvalid with every problem: a value of the wrong type or an unknown setting is
        left out (its default stands in) so the checks of the rest still run."""
        config: RunConfig = build_all(cls, data)
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
