"""The policy trainer: holds the model, its frozen reference and the optimizer; runs updates;
saves versioned checkpoints and resumes from the newest one.

Pure PyTorch (+ transformers model I/O): it never imports Django. The Celery task in
`workers.training_loop` feeds it `TrainSample`s and records what it returns.

Checkpoints: `run_dir/v00003/` is a normal HF directory (loadable by the inference server)
plus `trainer_state.pt` (optimizer state, update counter); under LoRA it is a peft adapter
directory (megabytes; its base is the run's start checkpoint, `core.lora`). A directory is
written under a temporary name and renamed when complete, so a crash never leaves a half
checkpoint.

It takes the run's trainer settings as they are (`training.config.TrainerConfig`): they
choose the mode, the precision and the optimizer, and set each update's learning rate.

A micro-batch's sequences go through the model packed in one row, without padding, each
attending only to itself (`core.generation.packed_logprobs`, `core.text_attention`); the
micro-batches are formed by tokens (`training.micro_batches`).

Modes: full fine-tuning (a frozen second copy is the KL reference), or LoRA adapters on the
language model's projections (`lora_rank` > 0; base weights frozen; the KL reference is the
same model with its adapters disabled, so nothing is held twice). Either can turn on
gradient checkpointing (activations recomputed in the backward pass); left at `auto`, the
memory plan turns it on where the GPU needs it (`training.memory_plan`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from core.artifacts import STATE_FILE
from core.encoding import (
    EncodedBatch,
    batch_from_parts,
    pack_parts,
    prompt_length,
    response_token_ids,
)
from core.generation import packed_logprobs, sequence_logprobs
from core.lora import (
    LoraSpec,
    add_adapters,
    attach_adapter,
    base_model,
    is_adapter_dir,
    is_peft_model,
)
from core.policy import Policy, load_policy, save_checkpoint
from core.samples import TrainSample, UpdateMetrics, samples_write
from core.text_attention import use_packed_text_attention
from training.config import CurationConfig, TrainerConfig
from training.image_features import ImageFeatures
from training.memory_plan import GIB, Sample, TrainerMemory, TrainerRequest, checkpoint_shape
from training.prompt_cache import PromptCache
from training.replicas import Replicas
from training.sharding import (
    full_model_state,
    full_optimizer_state,
    load_full_optimizer_state,
    shard_model,
)
from training.update import policy_update

if TYPE_CHECKING:  # peft is imported only by a run that trains adapters (core.lora)
    from peft import PeftModel


class _AdaptersOff(nn.Module):
    """The KL reference under LoRA: the trained model with its adapters switched off (the base
    it started from), computed on the one copy of the weights."""

    peft_model: PeftModel

    def __init__(self, peft_model: nn.Module) -> None:
        super().__init__()
        assert is_peft_model(peft_model)
        object.__setattr__(self, "peft_model", peft_model)  # not a submodule: no parameters


def _enable_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass. Non-reentrant, so
    frozen inputs (LoRA's frozen embeddings) still get gradients through the adapters."""
    base = base_model(model)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.config.use_cache = False


def version_dir(run_dir: Path, version: int) -> Path:
    return run_dir / f"v{version:05d}"


@dataclass
class TrainerState:
    updates: int = 0  # updates applied to the weights held now
    version: int = 0  # policy version of the weights held now (0 = the start checkpoint)


def trainer_precision(device: str, *, bf16: bool) -> tuple[torch.dtype, torch.dtype | None]:
    """The dtype of the weights the optimizer updates, and the dtype forward passes run in
    (None: the weights'). Mixed precision: fp32 weights and AdamW moments everywhere, with
    bf16 autocast on GPUs. In pure bf16 (8 bits of mantissa) an update at lr 1e-5 rounds to
    nothing on most weights, so a full fine-tuning run would barely move."""
    return torch.float32, (torch.bfloat16 if bf16 and device.startswith("cuda") else None)


class PolicyTrainer:
    """One run's trainer. Resume rule: the newest checkpoint whose version is among
    `published_versions` (the database knows it was published); anything newer is an orphan
    of a crash."""

    def __init__(
        self,
        *,
        config: TrainerConfig,
        start_checkpoint: Path,
        run_dir: Path,
        device: str = "cpu",
        published_versions: Sequence[int] = (),
        replicas: Replicas | None = None,
        prompt_cache_bytes: int = 2 * 1024**3,
        sample: Sample | None = None,
        pack: bool = True,
    ) -> None:
        """`config`: the run's trainer settings. `replicas`: this process is one of several
        data-parallel replicas (one per GPU, `training.replicas`); every replica builds the
        trainer the same way and calls `update` with the same samples, and only the leader
        saves versions. `prompt_cache_bytes`: host memory for the update's encoded prompts
        (`PromptCache`; 0 encodes a prompt on every pass). `sample`: the largest step the
        run's budgets allow, which the memory plan sizes with on a GPU (`auto` settings).
        `pack`: a micro-batch's sequences in one row without padding; False: left-padded
        rows, the baseline the benchmark and the tests compare against (the same log-probs
        and gradients)."""
        self.config = config
        lora = config.lora()
        self.run_dir = run_dir
        self.prompts = PromptCache(prompt_cache_bytes)
        # Off with the prompt cache: the baseline where every pass encodes everything.
        self.image_features = ImageFeatures(max_images=64 if prompt_cache_bytes > 0 else 0)
        self._shared_updates = 0  # batches handed to the replicas (their file names)
        self.replicas = replicas
        self.sharded = replicas is not None and replicas.sharded
        if self.sharded and lora is not None:
            raise ValueError("sharding is for full fine-tuning: LoRA adapters are replicated")
        self.device = device
        weights_dtype, self.autocast_dtype = trainer_precision(device, bf16=config.bf16)
        self.state = TrainerState()
        resume = self._resume_dir(published_versions)
        if lora is None:
            self.policy: Policy = load_policy(
                resume or start_checkpoint, device=device, dtype=weights_dtype
            )
        else:
            self.policy = self._load_with_adapters(start_checkpoint, resume, lora, device)
        self.pack = pack
        if pack:
            use_packed_text_attention(base_model(self.policy.model))
        self.policy.model.train()
        self._disable_dropout(self.policy.model)
        self.memory = self._plan_memory(start_checkpoint, sample)
        if config.gradient_checkpointing == "on" or (self.memory and self.memory.checkpointing):
            _enable_checkpointing(self.policy.model)
        if not config.micro_batch_tokens and self.memory is not None:  # auto: the plan's
            tokens = self.memory.micro_batch_tokens
            self.config = config = dataclasses.replace(config, micro_batch_tokens=tokens)
        if self.sharded:
            shard_model(self.policy.model, compute_dtype=self.autocast_dtype)
        self.ref_model: nn.Module | None = None
        if config.kl_coef > 0 and lora is not None:
            self.ref_model = _AdaptersOff(self.policy.model)
        elif config.kl_coef > 0:
            self.ref_model = load_policy(start_checkpoint, device=device).model.eval()
            if pack:
                use_packed_text_attention(self.ref_model)
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
            if self.sharded:
                shard_model(self.ref_model, compute_dtype=self.autocast_dtype)
        if replicas is not None and not self.sharded:
            replicas.align(self.trainable_parameters())
        # LoRA on the language model only: the vision tower's output is the same in every
        # pass of a micro-batch (`PromptCache.image_features`).
        visual = base_model(self.policy.model).model.visual
        self.vision_frozen = not any(p.requires_grad for p in visual.parameters())
        # No rate given here: `_set_lr` sets the schedule's before each update, the one place
        # the rate is set (AdamW's default is never stepped with).
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters(), weight_decay=config.weight_decay
        )
        if resume is not None:
            # weights_only: a state file is data (tensors, numbers), never code to unpickle.
            # Sharded replicas read the full state on the CPU and keep only their shards
            # (`load_full_optimizer_state`): on the GPU, every replica would hold all of it.
            where = "cpu" if self.sharded else device
            state = torch.load(resume / STATE_FILE, map_location=where, weights_only=True)
            if self.sharded:
                load_full_optimizer_state(self.policy.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.state = TrainerState(updates=state["updates"], version=state["version"])

    def _plan_memory(self, start: Path, sample: Sample | None) -> TrainerMemory | None:
        """On a GPU, the memory plan for the settings left at `auto` (`training.memory_plan`:
        gradient checkpointing, the micro-batch's tokens), sized to this GPU; None on a CPU, or
        without the run's budgets or a readable config (then checkpointing is off and the
        micro-batch `training.config.CPU_MICRO_BATCH_TOKENS`).

        Raises:
            DoesNotFit: nothing left at auto makes the trainer fit this GPU.
        """
        config = self.config
        shape = checkpoint_shape(start)
        if not self.device.startswith("cuda") or sample is None or shape is None:
            return None
        if config.gradient_checkpointing != "auto" and config.micro_batch_tokens:
            return None  # nothing left to pick
        gpu = torch.cuda.get_device_properties(torch.device(self.device))
        request = TrainerRequest.of(config, shape=shape, sample=sample)
        return request.plan(gpu.total_memory / GIB)

    @staticmethod
    def _load_with_adapters(
        start: Path, resume: Path | None, lora: LoraSpec, device: str
    ) -> Policy:
        """The start checkpoint with fresh adapters, or with the resumed version's adapter."""
        policy = load_policy(start, device=device)
        if resume is None:
            policy.model = add_adapters(policy.model, lora, base=start)  # type: ignore[assignment]
            return policy
        if not is_adapter_dir(resume):
            raise ValueError(
                f"{resume} holds full weights, but this run trains LoRA adapters: the run's "
                "trainer settings changed after it published (start a new run instead)"
            )
        policy.model = attach_adapter(policy.model, resume, trainable=True)  # type: ignore[assignment]
        policy.path = resume
        return policy

    def trainable_parameters(self) -> list[nn.Parameter]:
        """What the optimizer updates: every weight, or only the adapters under LoRA."""
        return [p for p in self.policy.model.parameters() if p.requires_grad]

    def _resume_dir(self, published: Sequence[int]) -> Path | None:
        for version in sorted(published, reverse=True):
            path = version_dir(self.run_dir, version)
            if (path / STATE_FILE).exists():
                return path
        return None

    @staticmethod
    def _disable_dropout(model: nn.Module) -> None:
        # pi_old and the training pass must agree exactly (see training.update).
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0

    def logprob_fn(
        self, model: nn.Module, samples: Sequence[TrainSample]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Response-token log-probs, entropies and mask [B, T] for a micro-batch: T the
        longest response when packed, the longest sequence when padded."""
        # policy_update passes back what update() gave it: self.policy.model or self.ref_model.
        if isinstance(model, _AdaptersOff):
            with model.peft_model.disable_adapter():
                return self.logprob_fn(model.peft_model, samples)
        assert isinstance(model, PreTrainedModel) or is_peft_model(model)
        responses = [
            list(s.response_token_ids)
            if s.response_token_ids
            else response_token_ids(self.policy, s.response_text)
            for s in samples
        ]
        prompts = [self.prompts.get(self.policy, s) for s in samples]
        if self.pack:
            packed = pack_parts(self.policy, prompts, responses=responses)
            features = self._frozen_image_features(samples, packed.row)
            with self.autocast():
                return packed_logprobs(model, packed, image_features=features)
        batch = batch_from_parts(self.policy, prompts, responses=responses)
        features = self._frozen_image_features(samples, batch)
        with self.autocast():
            return sequence_logprobs(model, batch, image_features=features)

    def _frozen_image_features(
        self, samples: Sequence[TrainSample], batch: EncodedBatch
    ) -> Any | None:
        """The micro-batch's image features when the vision tower is frozen (each screenshot
        through the tower once per update, `training.image_features`); None: the forward
        encodes the images."""
        if not self.vision_frozen or batch.patches is None:
            return None
        return self.image_features.of(batch, self._image_features)

    def _image_features(self, batch: EncodedBatch) -> Any:
        """The frozen vision tower's output for the batch's images (no gradient flows into
        it), as the model's forward takes it back (`mm_encoder_outputs`)."""
        batch = batch.to(self.policy.device)
        pixels = batch.pixel_values()
        assert pixels is not None and batch.image_grid_thw is not None
        inner = base_model(self.policy.model).model
        with torch.no_grad(), self.autocast():
            return inner.get_image_features(pixels, batch.image_grid_thw, return_dict=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward passes' precision (`trainer_precision`): bf16 autocast on GPUs."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=self.autocast_dtype)

    def _set_lr(self) -> None:
        """Set the optimizer to the schedule's learning rate for the next update (after
        `state.updates`): the one place the rate is set, before every update."""
        lr = self.config.lr_at(self.state.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def update(
        self,
        samples: Sequence[TrainSample],
        curation: CurationConfig,
        *,
        behaviour_cloning: bool = False,
        separate_old_pass: bool = False,
        stop: Callable[[], bool] | None = None,
    ) -> UpdateMetrics:
        """One policy update under the trainer's settings and the run's `curation`, at the
        schedule's learning rate. `behaviour_cloning`: a warm-start update, behaviour
        cloning on demos alone (bc_weight 1, no KL term). The leader of replicas hands the
        followers the same samples, settings and update count first
        (`training.replica_group`), so every replica takes this step. `separate_old_pass`:
        see `policy_update` (a benchmark's baseline). `stop`: asked between micro-batches;
        True raises `UpdateInterrupted` (ignored with replicas, which finish the update
        together)."""
        shared = None
        if self.replicas is not None and self.replicas.leader:
            # Followers on this host read the batch from a file instead of a pickle of every
            # screenshot sent through a collective; followers on other hosts get the pickle.
            batch: str | list[TrainSample] = list(samples)
            if self.replicas.one_host:
                self._shared_updates += 1
                shared = samples_write(
                    self.run_dir / ".replica-batches" / f"update-{self._shared_updates}.jsonl",
                    samples,
                )
                batch = str(shared)
            message = ("update", batch, curation, behaviour_cloning, self.state.updates)
            self.replicas.share(message)
        config = self.config
        if behaviour_cloning:
            config = dataclasses.replace(config, bc_weight=1.0, kl_coef=0.0)
        self._set_lr()
        # A demo's response as the tokens training sees, so every sample knows its length
        # before any pass (policy_update then needs no separate pi_old pass).
        samples = [
            s
            if s.response_token_ids
            else dataclasses.replace(
                s, response_token_ids=response_token_ids(self.policy, s.response_text)
            )
            for s in samples
        ]
        # What the micro-batches' token budget counts, read from the ids and image headers
        # (no image is decoded here).
        sample_tokens = [
            prompt_length(self.policy, s.messages, ids=s.prompt_token_ids)
            + len(s.response_token_ids or ())
            for s in samples
        ]
        self.prompts.clear()
        self.image_features.clear()
        # On a CPU, encoding ahead would take the cores the update runs on.
        ahead = None
        if torch.device(self.device).type == "cuda":
            ahead = partial(self.prompts.prefetch, self.policy, ahead=2)
        try:
            metrics = policy_update(
                model=self.policy.model,
                ref_model=self.ref_model,
                optimizer=self.optimizer,
                samples=samples,
                logprob_fn=self.logprob_fn,
                config=config,
                curation=curation,
                policy_version=self.state.version,
                replicas=self.replicas,
                separate_old_pass=separate_old_pass,
                stop=stop if self.replicas is None else None,
                sample_tokens=sample_tokens,
                encode_ahead=ahead,
            )
            metrics.encode_s, metrics.encode_reused = self.prompts.seconds, self.prompts.reused
            metrics.image_features_reused = self.image_features.reused
        finally:
            self.prompts.clear()
            self.image_features.clear()
            if shared is not None:  # every replica read it before the update's collectives
                shared.unlink(missing_ok=True)
        self.state.updates += 1
        return metrics

    def served_weights(self) -> tuple[Literal["full", "adapter"], dict[str, Tensor]]:
        """What inference workers serve of the weights held now, by parameter name (views,
        not copies): the adapters' under LoRA, else every weight. A sharded trainer holds
        only its shard (it syncs by checkpoint): ValueError."""
        if self.sharded:
            raise ValueError("a sharded trainer's weights exist whole only when gathered")
        if self.config.lora() is not None:
            return "adapter", {
                n: p.detach() for n, p in self.policy.model.named_parameters() if p.requires_grad
            }
        return "full", {n: p.detach() for n, p in self.policy.model.named_parameters()}

    @property
    def served_dtype(self) -> torch.dtype | None:
        """The dtype full weights travel to inference workers in: bf16 from a GPU trainer
        (its workers serve bf16), else as held (fp32: what a CPU worker serves, so what it
        receives equals what the checkpoint gives). Adapters travel as held (None)."""
        if self.config.lora() is None and self.device.startswith("cuda"):
            return torch.bfloat16
        return None

    def full_state(self) -> tuple[dict[str, Tensor] | None, dict]:
        """The weights to write (None: the model's own) and the optimizer state, unsharded.
        Collective when sharded: every replica calls it (followers through `save_version`'s
        message) and the leader writes."""
        if self.sharded:
            model = self.policy.model
            return full_model_state(model), full_optimizer_state(model, self.optimizer)
        return None, self.optimizer.state_dict()

    def save_version(self, version: int) -> Path:
        """Write the current weights as `version` (atomically) and return the directory.
        The leader of replicas has the followers take part (sharded weights are gathered)."""
        if self.replicas is not None:
            self.replicas.share(("save", version))
        weights, optimizer = self.full_state()
        final = version_dir(self.run_dir, version)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(self.policy, tmp, state_dict=weights)
        torch.save(
            {
                "optimizer": optimizer,
                "updates": self.state.updates,
                "version": version,
            },
            tmp / STATE_FILE,
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.state.version = version
        return final
