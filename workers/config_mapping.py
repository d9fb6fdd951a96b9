"""The one mapping from a run's config to what the DART modules take: `EpisodeConfig` for
rollout and evaluation. The trainer takes the run's `trainer` and `curation` sections as they
are (`training.config`): nothing to map.

Every RunConfig field is either mapped here or named in `READ_ELSEWHERE` with the module that
reads it; tests/workers/test_config_mapping.py checks both (that module reads the knob by
name), so a new knob cannot be dropped on the way to the code it is meant to change.
"""

from __future__ import annotations

from core.prompt_counter import PromptCounter
from datamanager.config import RunConfig
from datamanager.policies import policy_prompt_counter
from rollout.episode import EpisodeConfig

READ_ELSEWHERE: dict[str, str] = {
    "mode": "datamanager.live_work.run_live_work (decoupled or the synchronous driver)",
    "sync_lockstep": "workers.sync_loop.sync_round",
    "policy": "datamanager.policies (start checkpoint, image geometry and prompt counter)",
    "seed": "datamanager.services.episodes (task sampling and decode seeds)",
    "tasks.*": "datamanager.selectors.tasks.task_list",
    "env.*": "workers.slot_worker and datamanager.services.run_workers (slots, timeouts, heartbeats)",
    "rollout.request_timeout_s": "workers.slot_worker (the policy client's timeout)",
    "device": "hostagent.placement.place (the run's GPUs or the CPU)",
    "rollout.inference_workers": "hostagent.agent.run_specs (inference workers started)",
    "rollout.backend": "hostagent.agent.run_specs (which inference server it starts)",
    "rollout.vllm_gpus": "hostagent.placement.place (each vLLM worker's GPU)",
    "rollout.vllm_gpu_memory": "hostagent.launcher.vllm_specs (vLLM's --gpu-memory-utilization)",
    # The trainer takes its section as it is (training.config.TrainerConfig).
    "trainer.lr": "training.config.TrainerConfig.lr_at (each update's rate, PolicyTrainer._set_lr)",
    "trainer.lr_schedule": "training.config.TrainerConfig.lr_at",
    "trainer.lr_warmup_updates": "training.config.TrainerConfig.lr_at",
    "trainer.lr_decay_updates": "training.config.TrainerConfig.lr_at",
    "trainer.lr_min_ratio": "training.config.TrainerConfig.lr_at",
    "trainer.grad_clip": "training.update (clipping before each optimizer step)",
    "trainer.micro_batch": "training.old_logprobs.batches (micro-batches, training.micro_batches)",
    "trainer.micro_batch_tokens": "training.old_logprobs.batches (micro-batches, training.micro_batches)",
    "trainer.loss_type": "training.update (the policy loss)",
    "trainer.loss_aggregation": "training.update_plan and training.update (step weights)",
    "trainer.clip_low": "training.config.TrainerConfig.pg_clip (the policy loss's clip range)",
    "trainer.clip_high": "training.config.TrainerConfig.pg_clip",
    "trainer.gspo_clip_low": "training.config.TrainerConfig.pg_clip",
    "trainer.gspo_clip_high": "training.config.TrainerConfig.pg_clip",
    "trainer.ppo_epochs": "training.update.policy_update",
    "trainer.mini_batches": "training.update.policy_update",
    "trainer.kl_coef": "training.update and training.trainer (the reference model)",
    "trainer.bc_weight": "training.update (the behaviour-cloning term)",
    "trainer.logprob_gap_alert": "dartboard.viewmodels.run_alerts, datamanager.selectors.charts.training_metrics",
    "trainer.stale_serving_alert": "dartboard.viewmodels.run_alerts (the run page)",
    "trainer.left_out_alert": "datamanager.selectors.env_health.health_alerts (the run page)",
    "trainer.weight_decay": "training.trainer.PolicyTrainer (the optimizer)",
    "trainer.min_groups": "datamanager.services.batches.batch_collect",
    "trainer.max_steps_per_update": "datamanager.services.batches.batch_collect",
    "trainer.warm_start_bc_updates": "workers.training_loop (the warm start)",
    "trainer.pool_mix_steps": "workers.training_loop (pool demos mixed into each RL update)",
    "trainer.checkpoint_every": "workers.training_loop (when a version is published)",
    "trainer.optimizer_states_kept": "workers.artifacts.optimizer_states_prune (after a publish)",
    "trainer.versions_kept": "workers.artifacts.versions_prune (after a publish)",
    "trainer.versions_keep_every": "workers.artifacts.versions_prune (after a publish)",
    "trainer.max_updates": "workers.training_loop.run_loop",
    "trainer.bf16": "training.trainer.PolicyTrainer (precision)",
    "trainer.lora_rank": "training.config.TrainerConfig.lora (LoRA or full fine-tuning)",
    "trainer.lora_alpha": "training.config.TrainerConfig.lora",
    "trainer.lora_vision": "training.config.TrainerConfig.lora",
    "trainer.gradient_checkpointing": "training.trainer.PolicyTrainer",
    "trainer.replicas": "workers.training_loop.get_trainer and hostagent.agent.run_needs "
    "(training.memory_plan.trainer_layout at auto; followers started)",
    "trainer.shard": "training.replica_group (FSDP2 over the replicas; trainer_layout at auto)",
    "trainer.replica_timeout_s": "training.replica_group.GroupSetup.join (every collective)",
    # The update reads these curation knobs as they are (training.config.CurationConfig).
    "curation.high_entropy": "training.config.CurationConfig.entropy_q (the entropy filter)",
    "curation.entropy_top_q": "training.config.CurationConfig.entropy_q",
    "curation.entropy_recenter": "training.update_plan.plan_update",
    "curation.truncated_is": "training.old_logprobs and training.update (IS weights)",
    "curation.is_cap": "training.old_logprobs (the IS weights' cap)",
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


def episode_config(
    cfg: RunConfig,
    *,
    step_cap: int,
    seed: int | None,
    temperature: float | None = None,
    counter: PromptCounter | None = None,
) -> EpisodeConfig:
    """Rollout settings of this run for one episode. `temperature` overrides the run's
    (evaluation decodes greedily with 0); `counter` that of the run's policy (evaluation of
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
        prompt_counter=counter or policy_prompt_counter(cfg.policy),
    )
