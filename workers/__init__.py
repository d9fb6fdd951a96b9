"""Workers: the Celery tasks and the long-running loops behind them, where the data manager
meets the DART modules (environments, the policy client, the trainer).

- `tasks`: the Celery tasks, thin interfaces over the loops (queues `env`, `train`, `default`);
- env slots: `slot_worker` (one environment per worker process, running episodes on it),
  `episode_runner` (one episode, recorded step by step), `env_cache` (this process's
  environments); `evaluation`: an evaluation job's shards;
- the trainer: `training_loop` (one run's trainer), `sync_loop` with `lockstep` (the
  synchronous baseline), `config_mapping` (a run's config to what the DART modules take),
  `artifacts` (published versions in the artifact store), `exports` with `exports_wandb` and
  `exports_mlflow` (a run's scalars in TensorBoard, W&B and MLflow);
- keeping work alive: `leases`, `watchdog`, `lifecycle`, `dbutil` (outage retries), `disk` (a
  full disk pauses a run);
- commands: `start_run`, `evaluate`, `collect_demos`, `import_builtin_tasks`,
  `make_tiny_policy`, `pretrain_policy`.

May import `datamanager`, the DART modules (`envmanager`, `rollout`, `training`) and `core`;
never the web (`dartboard`) or `hostagent` (pyproject.toml's import-linter layers).
"""
