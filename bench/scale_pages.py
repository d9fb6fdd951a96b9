"""Dashboard pages after 1,000,000 recorded steps with 1,000 env slots (bench/scale.py).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/NAME REDIS_URL=... DARTBOARD_HOME=... \\
        .venv/bin/python -m bench.scale_pages --steps 1000000 --out pages.json

Fills the database the way bench/pages.py does (bulk inserts, 20 steps a trajectory), makes
the big run a 1,000-slot sim run with a slot row per slot (the last 1,000 trajectories are
their current episodes), then times each page with Django's test client, logged in (median
of --repeat requests after one warm-up request), as bench/pages.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _more_slots(run_id: int, slots: int) -> None:
    from django.db import transaction

    from datamanager.config import RunConfig
    from datamanager.models import EnvSlot, Run, SlotStatus, Trajectory, TrajectoryStatus

    with transaction.atomic():
        run = Run.objects.get(pk=run_id)
        cfg = RunConfig.from_dict({**run.config, "env": {"miniwob_slots": 0, "sim_slots": slots}})
        run.config = cfg.to_dict()
        run.save(update_fields=["config"])
        EnvSlot.objects.filter(run=run).delete()
        current = list(
            Trajectory.objects.filter(run=run).order_by("-pk").values_list("pk", flat=True)[:slots]
        )
        Trajectory.objects.filter(pk__in=current).update(
            status=TrajectoryStatus.RUNNING, finished_at=None
        )
        statuses = [SlotStatus.BUSY] * 17 + [
            SlotStatus.IDLE,
            SlotStatus.RECOVERING,
            SlotStatus.QUARANTINED,
        ]
        EnvSlot.objects.bulk_create(
            [
                EnvSlot(
                    name=f"worker-{i // 250}:{4000 + i // 250}:sim:{i}",
                    key=f"sim:{i}",
                    host=f"worker-{i // 250}",
                    backend="sim",
                    run=run,
                    status=statuses[i % len(statuses)],
                    current_trajectory_id=current[i],
                    last_heartbeat=run.started_at,
                    last_error="EnvUnavailable: reset timed out" if i % 20 == 19 else "",
                )
                for i in range(slots)
            ],
            batch_size=1000,
        )


def _group_history(run_id: int, groups: int) -> None:
    """One TaskStatHistory row per finished group, as `_maybe_ready` writes them (bench/pages.py
    writes 60 a task; a run that recorded 1,000,000 steps in groups of 4 finished ~12,500)."""
    from datetime import timedelta

    from datamanager.models import Run, TaskStat, TaskStatHistory

    run = Run.objects.get(pk=run_id)
    tasks = list(TaskStat.objects.filter(run=run).values_list("task_id", flat=True))
    start = run.started_at
    span = 5 * 3600
    TaskStatHistory.objects.bulk_create(
        [
            TaskStatHistory(
                run=run,
                task_id=tasks[g % len(tasks)],
                at=start + timedelta(seconds=span * g / groups),
                success_rate=min(1.0, 0.2 + 0.8 * g / groups),
                rollout_budget=max(2, 8 - 6 * g // groups),
                step_cap=15,
                pool_size=2,
            )
            for g in range(groups)
        ],
        batch_size=5000,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--steps-per-trajectory", type=int, default=20)
    ap.add_argument("--slots", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.core.management import call_command
    from django.db import connection
    from django.utils import timezone

    from bench.pages import fill, measure
    from datamanager.models import EnvSlot, Step, Trajectory
    from datamanager.roles import role_group

    call_command("migrate", verbosity=0)
    t0 = time.perf_counter()
    run_id = fill(
        n_traj=args.steps // args.steps_per_trajectory, steps_per=args.steps_per_trajectory
    )
    _more_slots(run_id, args.slots)
    _group_history(run_id, args.steps // args.steps_per_trajectory // 4)
    User.objects.get(username="ada").groups.add(role_group("viewer"))  # pages need a role
    EnvSlot.objects.update(last_heartbeat=timezone.now())
    with connection.cursor() as cur:
        cur.execute("ANALYZE")
    fill_s = time.perf_counter() - t0
    rows = measure(run_id=run_id, repeat=args.repeat)
    result = {
        "steps": Step.objects.count(),
        "trajectories": Trajectory.objects.count(),
        "slots": EnvSlot.objects.filter(run_id=run_id).count(),
        "fill_s": fill_s,
        "repeat": args.repeat,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
