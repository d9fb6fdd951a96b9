"""Data manager: the models, services (writes), selectors (reads) and curation policies.

- `models`: tasks, runs, trajectories, steps, groups, difficulty statistics, versions;
- `config` (with `config_fields` and `config_training`): a run's settings, one dataclass
  field each, parsed once per run row (`Run.cfg`);
- `services`: every write, one short transaction each. A rollout's step is stored by
  `services.episodes.step_store` (many at once: `services.steps`), and every Step row is
  made in `services.step_rows.step_row`; a claim, a finished trajectory and the curation it
  triggers are `services.episodes`; the trainer's batch is `services.batches`;
- `selectors`: every read the web, the API and the workers share (slot liveness:
  `selectors.runs.lost_slots_q`; pool membership: `selectors.pool`);
- `curation`: the adaptive rules themselves (budgets, step caps, pool fill), pure functions;
- `demos` and `task_import`: demonstrations and tasks brought in; `archive`: what retention
  moves out.
"""
