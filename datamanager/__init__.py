"""Data manager: the models, services (writes), selectors (reads) and curation policies.

- `models`: tasks, runs, trajectories, steps, groups, difficulty statistics, versions;
- `config`: a run's settings, one dataclass field each (the trainer's and curation's
  sections are `training.config`'s), parsed once per loaded run (`Run.cfg`);
- `services`: every write, one short transaction each. Every step (`core.steps.StepRecord`:
  a rollout's, a demonstration's, a trimmed copy's) is stored by `services.steps.steps_store`;
  a claim, a finished trajectory and the curation it triggers are `services.episodes`; the
  trainer's batch is `services.batches`;
- `selectors`: every read the web, the API and the workers share (slot liveness:
  `selectors.runs.lost_slots_q`; pool membership: `selectors.pool`; what a step's policy
  was given and is trained to answer, for training and export: `selectors.steps`);
- `curation`: the adaptive rules themselves (budgets, step caps, pool fill), pure functions;
- `live_work`: a run's long-running Celery tasks (env slots, its trainer, evaluation shards)
  named and enqueued by name, so the services start them without importing `workers`;
- `demos` and `task_import`: demonstrations and tasks brought in; `archive`: what retention
  moves out.

May import the DART modules (`envmanager`, `rollout`, `training`) and `core`; never
`workers`, the web (`dartboard`) or `hostagent` (pyproject.toml's import-linter layers).
"""
