"""The use cases: every write a view, an API endpoint, a command, a Celery task or the host
agent performs goes through one function here (`<entity>_<verb>`, keyword-only), which may
enqueue Celery work by name after commit but never imports `workers`.

- `runs` (a run's settings checked and its row made), `run_workers` (started, paused,
  resumed, stopped with its workers), `sweeps`, `evaluations`;
- `episodes` (a task claimed, a trajectory finished and the curation it triggers), `steps`
  (every step stored: `steps_store`), `batches` (the trainer's batch, and what an update did),
  `versions` (policy versions published and served), `pool` (the experience pool);
- `demos` (demonstrations imported), `review` (trajectories curated by hand), `labels`
  (failure labels), `datasets` (exports);
- `env_slots`, `placement`, `process_logs`, `outages`, `tokens`: slots, hosts and
  processes, the processes' logs, service outages, API tokens.
"""
