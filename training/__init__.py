"""Trainer side of Dartboard, pure PyTorch (no Django): the policy trainer and its update.

- `trainer`: `PolicyTrainer` holds the model, its frozen reference and the optimizer, runs
  updates and saves versions; `update`: one step-level GRPO update with DART's curation;
- `ranges`: the update's knobs, their defaults and valid values (no torch: the web checks
  run settings with it);
- `replicas`, `replica_group`, `sharding`: data-parallel replicas and FSDP2 over GPUs;
- `tiny_policy`, `pretrain`, `synthetic`, `synthetic_desktop`: the tiny CPU policy, built
  from a config and pretrained on synthetic screens.

The losses and the shared model I/O (loading a policy, encoding prompts, generation) live in
`core`; the loop that feeds the trainer from the data manager is `workers.training_loop`.
"""
