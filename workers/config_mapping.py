"""The one mapping from a run's config to what the DART modules take: `UpdateConfig` for the
trainer, `EpisodeConfig` for rollout and evaluation.

Every RunConfig field is either mapped here or named in `READ_ELSEWHERE` with the place that
reads it; tests/workers/test_config_mapping.py checks both, so a new knob cannot be dropped
on the way to the code it is meant to change.
"""

from __future__ import annotations

import math

from core.imaging import ImageGeometry
from core.lora import LoraSpec
from datamanager.config import RunConfig, TrainerConfig
from datamanager.policies import policy_geometry
from rollout.episode import EpisodeConfig
from training.ranges import UpdateConfig

READ_ELSEWHERE: dict[str, str] = {
    "mode": "workers.runs.run_live_work (decoupled or the synchronous driver)",
    "sync_lockstep": "workers.sync_loop.sync_round",
    "policy": "datamanager.policies (start checkpoint and image geometry)",
    "seed": "datamanager.services.episodes (task sampling and decode seeds)",
    "tasks.*": "datamanager.selectors.tasks.task_list",
    "env.*": "workers.slot_worker and workers.runs (slots, timeouts, heartbeats)",
    "rollout.request_timeout_s": "workers.slot_worker (the policy client's timeout)",
    "device": "hostagent.placement.place (the run's GPUs or the CPU)",
    "rollout.inference_workers": "hostagent.agent.run_specs (inference workers started)",
    "rollout.backend": "hostagent.agent.run_specs (which inference server it starts)",
    "rollout.vllm_gpus": "hostagent.placement.place (each vLLM worker's GPU)",
    "rollout.vllm_gpu_memory": "hostagent.launcher.vllm_specs (vLLM's --gpu-memory-utilization)",
    "trainer.lr_schedule": "scheduled_lr below (each update's learning rate)",
    "trainer.lr_warmup_updates": "scheduled_lr below",
    "trainer.lr_decay_updates": "scheduled_lr below",
    "trainer.lr_min_ratio": "scheduled_lr below",
    "trainer.logprob_gap_alert": "dartboard.viewmodels.run_alerts, datamanager.selectors.charts.training_metrics",
    "trainer.stale_serving_alert": "dartboard.viewmodels.run_alerts (the run page)",
    "trainer.left_out_alert": "datamanager.selectors.env_health.health_alerts (the run page)",
    "trainer.weight_decay": "workers.training_loop.get_trainer (the optimizer)",
    "trainer.min_groups": "datamanager.services.batches.batch_collect",
    "trainer.max_steps_per_update": "datamanager.services.batches.batch_collect",
    "trainer.warm_start_bc_updates": "workers.training_loop (the warm start)",
    "trainer.pool_mix_steps": "workers.training_loop (pool demos mixed into each RL update)",
    "trainer.checkpoint_every": "workers.training_loop (when a version is published)",
    "trainer.optimizer_states_kept": "workers.artifacts.optimizer_states_prune (after a publish)",
    "trainer.versions_kept": "workers.artifacts.versions_prune (after a publish)",
    "trainer.versions_keep_every": "workers.artifacts.versions_prune (after a publish)",
    "trainer.max_updates": "workers.training_loop.run_loop",
    "trainer.bf16": "workers.training_loop.get_trainer",
    "trainer.lora_rank": "lora_spec below (LoRA or full fine-tuning)",
    "trainer.lora_alpha": "lora_spec below",
    "trainer.lora_vision": "lora_spec below",
    "trainer.gradient_checkpointing": "workers.training_loop.get_trainer",
    "trainer.replicas": "workers.training_loop.get_trainer (followers started)",
    "trainer.shard": "workers.training_loop.get_trainer (FSDP2 over the replicas)",
    "curation.dynamic_budget": "datamanager.services.episodes (rollout budgets)",
    "curation.n_max": "datamanager.services.episodes (rollout budgets)",
    "curation.n_min": "datamanager.services.episodes (rollout budgets)",
    "curation.budget_threshold": "datamanager.services.episodes (rollout budgets)",
    "curation.dynamic_step_cap": "datamanager.services.episodes (step caps)",
    "curation.default_step_cap": "datamanager.services.episodes (step caps)",
    "curation.step_cap_margin": "datamanager.services.episodes (step caps)",
    "curation.experience_pool": "datamanager.services.episodes and batches (pool joins)",
    "curation.error_retries": "datamanager.services.episodes (a crashed member replaced)",
    "curation.pool_ratio": "datamanager.services.episodes (pool joins)",
    "curation.staleness_k": "datamanager.services.batches (stale steps left out)",
    "curation.max_uses_per_step": "datamanager.services.batches",
    "curation.backpressure": "workers.slot_worker (training claims held while the trainer is behind)",
    "curation.success_window": "datamanager.services.episodes (task success rates)",
    "evaluation.*": "workers.evaluation (scheduled evaluation)",
}


def lora_spec(trainer: TrainerConfig) -> LoraSpec | None:
    """The adapters the trainer adds, or None for full fine-tuning."""
    if trainer.lora_rank == 0:
        return None
    return LoraSpec(rank=trainer.lora_rank, alpha=trainer.lora_alpha, vision=trainer.lora_vision)


def scheduled_lr(trainer: TrainerConfig, updates_done: int) -> float:
    """The learning rate of a run's next update, after `updates_done` updates (warm-start
    updates count): a linear warm-up to `lr`, then constant, or a cosine or linear decay to
    `lr * lr_min_ratio` over `lr_decay_updates` updates, held there afterwards."""
    n = updates_done + 1
    if n <= trainer.lr_warmup_updates:
        return trainer.lr * n / trainer.lr_warmup_updates
    if trainer.lr_schedule == "constant":
        return trainer.lr
    progress = min(1.0, (n - trainer.lr_warmup_updates - 1) / trainer.lr_decay_updates)
    shape = (
        (1 + math.cos(math.pi * progress)) / 2 if trainer.lr_schedule == "cosine" else 1 - progress
    )
    low = trainer.lr * trainer.lr_min_ratio
    return low + (trainer.lr - low) * shape


def update_config(cfg: RunConfig, *, updates_done: int) -> UpdateConfig:
    """The trainer's knobs for one RL update of this run, the next after `updates_done`."""
    t, c = cfg.trainer, cfg.curation
    return UpdateConfig(
        lr=scheduled_lr(t, updates_done),  # the optimizer starts at trainer.lr (get_trainer)
        loss_type=t.loss_type,
        aggregation=t.loss_aggregation,
        clip_low=t.clip_low,
        clip_high=t.clip_high,
        gspo_clip_low=t.gspo_clip_low,
        gspo_clip_high=t.gspo_clip_high,
        kl_coef=t.kl_coef,
        bc_weight=t.bc_weight,
        entropy_top_q=c.entropy_top_q if c.high_entropy else 1.0,
        entropy_recenter=c.entropy_recenter,
        truncated_is=c.truncated_is,
        is_cap=c.is_cap,
        micro_batch=t.micro_batch,
        mini_batches=t.mini_batches,
        ppo_epochs=t.ppo_epochs,
        max_grad_norm=t.grad_clip,
    )


def episode_config(
    cfg: RunConfig,
    *,
    step_cap: int,
    seed: int | None,
    temperature: float | None = None,
    geometry: ImageGeometry | None = None,
) -> EpisodeConfig:
    """Rollout settings of this run for one episode. `temperature` overrides the run's
    (evaluation decodes greedily with 0); `geometry` that of the run's policy (evaluation of
    another checkpoint)."""
    r = cfg.rollout
    return EpisodeConfig(
        step_cap=step_cap,
        max_images=r.max_images,
        max_prompt_tokens=r.max_prompt_tokens,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        max_parse_errors=r.max_parse_errors,
        coords=r.coords,
        prompt=r.prompt,
        language=r.language,
        seed=seed,
        image_geometry=geometry or policy_geometry(cfg.policy),
    )
