"""Environment cluster: the GUI environments behind one protocol (`core.protocol`), and the
sandbox every program the policy drives runs in.

- backends: `miniwob_env` (MiniWoB++ in chromium), `desktop_env` (an X desktop driven by
  xdotool), `osworld_env` (an OSWorld VM, or a Dartboard desktop serving its protocol through
  `osworld_server`), `sim_env` (synthetic screens, for load tests);
- tasks: `miniwob_tasks`, `desktop_tasks`, `osworld_tasks` (and the files their setup steps
  read, `osworld_task_files`), scored by the backend or by OSWorld's own evaluator
  (`osworld_evaluator`, its metrics in a process of their own);
- containment: `sandbox`, `sandbox_limits`, `seccomp`, `sandboxed_browser`, `xserver`;
- oracles that solve tasks for demonstrations and tests: `oracles`, `osworld_oracles`,
  `oracle_policy`, `demo_collection`.

Env slots (which environment serves which run, their heartbeats and leases) and their Celery
tasks are `workers.slot_worker`; an environment is built for a slot by `workers.env_cache`.

May import `core` only: not `rollout` or `training`, and never Django or Celery
(pyproject.toml's import-linter contracts).
"""
