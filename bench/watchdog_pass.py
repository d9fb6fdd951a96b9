"""The watchdog's pass over N env slots on PostgreSQL, its own time, apart from any load.

    .venv/bin/python bench/watchdog_pass.py [--slots 3000] [--pg postgres://postgres@127.0.0.1:5432]

A fresh database and a private Redis (as bench/scale.py's); one running run of N sim slots,
each with its slot row, a running trajectory and its lease held in Redis. Printed: the time
of `workers.watchdog.watchdog_pass` (5 passes), first with every heartbeat fresh, then with
every heartbeat an hour old while the leases are held (what a busy database that delays the
heartbeats looks like to the pass: every running trajectory matches the orphans' query and is
kept for its lease). Nothing is aborted or enqueued in either case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASSES = 5


def _passes() -> list[float]:
    from workers.watchdog import watchdog_pass

    times = []
    for _ in range(PASSES):
        started = time.perf_counter()
        restarted = watchdog_pass()
        times.append((time.perf_counter() - started) * 1000)
        if restarted:
            raise RuntimeError(f"the pass enqueued work again: {restarted[:3]}")
    return times


def measure(slots: int, out: Path) -> None:
    """In the environment bench/scale.py's `_one` sets: fill, time, write JSON to `out`."""
    import django

    django.setup()
    from django.utils import timezone

    from bench.scale_load import _setup
    from datamanager.live_work import redis_client, slot_work
    from datamanager.models import EnvSlot, Run, Task, Trajectory, TrajectoryStatus

    run = Run.objects.get(pk=_setup(slots))
    tasks = list(Task.objects.filter(name__startswith="sim/click-"))
    EnvSlot.objects.bulk_create(
        [
            EnvSlot(name=f"h:1:sim:{i}", key=f"sim:{i}", host="h", backend="sim", run=run,
                    status="busy", last_heartbeat=timezone.now())
            for i in range(slots)
        ],
        batch_size=1000,
    )  # fmt: skip
    Trajectory.objects.bulk_create(
        [
            Trajectory(run=run, task=tasks[i % len(tasks)], env_slot=slot,
                       status=TrajectoryStatus.RUNNING)
            for i, slot in enumerate(EnvSlot.objects.filter(run=run).order_by("pk"))
        ],
        batch_size=1000,
    )  # fmt: skip
    client = redis_client()
    pipe = client.pipeline()
    for i in range(slots):
        pipe.set(
            slot_work(run_id=run.pk, backend="sim", index=i).lease_key, f"h:1:sim:{i}", ex=3600
        )
    pipe.execute()
    client.close()
    fresh = _passes()
    EnvSlot.objects.filter(run=run).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    late = _passes()
    out.write_text(json.dumps({"slots": slots, "fresh_ms": fresh, "late_ms": late}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=3000)
    ap.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432")
    ap.add_argument("--keep", action="store_true", help="keep the database")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.measure:  # the child: bench/scale.py's `_one` runs it in its environment
        measure(args.slots, args.out)
        return
    from bench.scale import _one

    with tempfile.TemporaryDirectory() as tmp:
        what = ["bench.watchdog_pass", "--measure", "--slots", str(args.slots)]
        result = _one(args, what, f"dartboard_watchdog_{args.slots}", Path(tmp) / "r.json")
    for label, key in (("heartbeats fresh", "fresh_ms"), ("heartbeats an hour late, leases held", "late_ms")):  # fmt: skip
        ms = result[key]
        print(f"{result['slots']} slots, {label}: pass median {statistics.median(ms):.0f} ms, "
              f"max {max(ms):.0f} ms ({', '.join(f'{x:.0f}' for x in ms)})")  # fmt: skip


if __name__ == "__main__":
    main()
