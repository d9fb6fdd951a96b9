"""Trainer side of Dartboard, pure PyTorch (no Django): the policy trainer and its update.

- `config`: the run's trainer and curation settings, one object each from the run form to
  the optimizer (no torch: the web checks run settings with it);
- `trainer`: `PolicyTrainer` holds the model, its frozen reference and the optimizer, runs
  updates and saves versions; `weight_server`: the newest version held in memory and sent to
  the inference workers that pull it; `update`: one step-level GRPO update with DART's curation
  (`update_plan`: which steps train; `old_logprobs`: pi_old, the reference and IS weights);
- `replicas`, `replica_group`, `sharding`: data-parallel replicas and FSDP2 over GPUs;
- `tiny_policy`, `pretrain`, `synthetic`, `synthetic_desktop`: the tiny CPU policy, built
  from a config and pretrained on synthetic screens.

The losses and the shared model I/O (loading a policy, encoding prompts, generation) live in
`core`; the loop that feeds the trainer from the data manager is `workers.training_loop`.

May import `core` only; never another DART module (`envmanager`, `rollout`), the data manager,
Django or Celery (pyproject.toml's import-linter contracts).
"""
