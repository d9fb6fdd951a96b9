"""Selectors: every read the web, the API and the workers share, one module per page or
subject, keyword-only functions returning querysets, rows or dataclasses; writes are
`datamanager.services`.

- pages: `runs` (the runs list, a run's header and task board), `charts` and `env_health`
  (over `aggregates`), `dashboard` (the env wall, hosts, alerts), `flow`, `metrics`,
  `scalars`, `trajectories`, `groups`, `evaluations`, `labels`, `outages`, `accounts`,
  `process_logs` (a run's process logs);
- shared definitions: `pool` (the experience pool), `steps` (what a stored step's policy was
  given and is trained to answer), `tasks`.
"""
