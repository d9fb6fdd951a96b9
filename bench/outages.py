"""How long a live run takes to recover when Redis or the database goes away.

    .venv/bin/python bench/outages.py [--slots 2] [--pg-down 20] [--redis-down 12]

Runs `make run`'s processes on a private stack (bench/stack.py: embedded Redis, env workers
with chromium, the trainer, the shipped tiny policy behind the router, Celery beat) with
the workers' default lease, watchdog and retry settings, and breaks, in turn:
1. the embedded Redis, SIGKILLed (the supervisor restarts it, as the launcher does);
2. the embedded Redis, stopped for --redis-down seconds and started without its data (a
   Redis server run without persistence);
3. PostgreSQL (a private cluster, bench/../tests/private_services.py), stopped for --pg-down
   seconds (fast shutdown: connections cut) and started again.
For each it prints when things were back, counted from the moment the service was back:
a Celery task's round trip, every slot and the trainer holding their leases again, the
first step recorded, the first episode finished, the first trainer update; and how many
steps were recorded while it was down. Scenarios 1-2 run on SQLite, 3 on the PostgreSQL
cluster; each in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stack import PrivateStack  # noqa: E402

TASKS = ["click-test", "click-test-2", "click-button", "click-link"]


def _run_config(slots: int) -> dict[str, Any]:
    return {
        "policy": "shipped",
        "tasks": {"names": [f"miniwob/{n}" for n in TASKS], "instances": 10},
        "env": {"miniwob_slots": slots},
        "rollout": {"max_new_tokens": 48, "max_images": 3, "max_parse_errors": 1},
        "trainer": {"min_groups": 1, "micro_batch": 4, "max_steps_per_update": 32},
    }


class Probe:
    """Polls the stack for each sign of recovery after `back` (a monotonic time)."""

    def __init__(self, stack: PrivateStack, run_id: int) -> None:
        self.stack = stack
        self.run_id = run_id

    def counts(self) -> tuple[int, int, int]:
        from datamanager.models import SCORED_STATUSES, Step, TrainUpdate, Trajectory

        return (
            Step.objects.filter(trajectory__run_id=self.run_id).count(),
            Trajectory.objects.filter(run_id=self.run_id, status__in=SCORED_STATUSES).count(),
            TrainUpdate.objects.filter(run_id=self.run_id).count(),
        )

    def celery_round_trip(self) -> bool:
        from celery import current_app

        try:
            current_app.send_task("workers.tasks.ping", queue="default").get(timeout=3)
            return True
        except Exception:
            return False

    def leases_held(self) -> bool:
        from datamanager.live_work import redis_client, run_live_work
        from datamanager.models import Run

        try:
            run = Run.objects.get(pk=self.run_id)
            client = redis_client()
            try:
                works = run_live_work(run_id=run.pk, cfg=run.cfg)
                return all(client.exists(w.lease_key) for w in works)
            finally:
                client.close()
        except Exception:
            return False

    def recovery(self, back: float, base: tuple[int, int, int], limit_s: float) -> dict:
        """Seconds after `back` until each sign; None if not within `limit_s`."""
        from django.db import connection

        signs: dict[str, float | None] = dict.fromkeys(
            ("celery", "leases", "step", "episode", "update")
        )
        while time.monotonic() - back < limit_s and None in signs.values():
            self.stack.supervisor.watch_once()
            now = time.monotonic() - back
            try:
                steps, episodes, updates = self.counts()
            except Exception:
                connection.close()
                time.sleep(0.5)
                continue
            for key, ok in (
                ("step", steps > base[0]),
                ("episode", episodes > base[1]),
                ("update", updates > base[2]),
            ):
                if signs[key] is None and ok:
                    signs[key] = now
            if signs["celery"] is None and self.celery_round_trip():
                signs["celery"] = time.monotonic() - back
            if signs["leases"] is None and self.leases_held():
                signs["leases"] = time.monotonic() - back
            time.sleep(0.5)
        return signs


def _start(stack: PrivateStack, slots: int) -> Probe:
    from datamanager.config import RunConfig
    from datamanager.services.run_workers import run_start_workers
    from datamanager.services.runs import run_control, run_create

    run = run_create(name="outages", config=RunConfig.from_dict(_run_config(slots)))
    run_control(run_id=run.pk, action="start")
    run_start_workers(run_id=run.pk)
    probe = Probe(stack, run.pk)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        stack.supervisor.watch_once()
        _, episodes, updates = probe.counts()
        if episodes >= 4 and updates >= 1:
            return probe
        time.sleep(1)
    raise SystemExit(f"the run did not get going in 10 minutes; logs in {stack.home / 'logs'}")


def _during(probe: Probe, seconds: float) -> int:
    """Wait out a Redis outage; returns the steps recorded meanwhile."""
    before = probe.counts()[0]
    time.sleep(seconds)
    return probe.counts()[0] - before


def child_redis(args: argparse.Namespace) -> list[dict]:
    rows = []
    with PrivateStack(slots=args.slots, policy="shipped") as stack:
        probe = _start(stack, args.slots)
        # 1. SIGKILL; the supervisor's next watch restarts it (the launcher watches every 1 s).
        base = probe.counts()
        assert stack.redis.proc is not None
        os.kill(stack.redis.proc.pid, signal.SIGKILL)
        stack.redis.proc.wait()
        killed = time.monotonic()
        time.sleep(1.0)
        stack.supervisor.watch_once()
        back = time.monotonic()
        signs = probe.recovery(back, base, args.limit)
        rows.append({"what": "embedded Redis SIGKILLed, restarted by the launcher",
                     "down_s": back - killed, "during": None, **signs})  # fmt: skip
        # 2. Stopped, then back empty.
        time.sleep(10)
        stack.supervisor.redis = None
        stack.redis.stop()
        for leftover in stack.redis.dir.glob("appendonly*"):
            leftover.unlink()
        stopped = time.monotonic()
        during = _during(probe, args.redis_down)
        stack.redis.persist = False
        stack.redis.start()
        stack.supervisor.redis = stack.redis
        back = time.monotonic()
        signs = probe.recovery(back, probe.counts(), args.limit)
        rows.append({"what": f"Redis stopped {args.redis_down:.0f} s, back without its data",
                     "down_s": back - stopped, "during": during, **signs})  # fmt: skip
    return rows


def child_postgres(args: argparse.Namespace) -> list[dict]:
    from tests.private_services import PrivatePostgres

    cluster = PrivatePostgres().init()
    cluster.start()
    try:
        url = cluster.create_database("dartboard_bench")
        with PrivateStack(slots=args.slots, policy="shipped", database_url=url) as stack:
            probe = _start(stack, args.slots)
            cluster.stop()
            stopped = time.monotonic()
            time.sleep(args.pg_down)  # nothing can be counted: the database is the counter
            cluster.start()
            back = time.monotonic()
            from django.db import connection

            connection.close()
            base = _counts_when_up(probe)
            signs = probe.recovery(back, base, args.limit)
            return [{"what": f"PostgreSQL stopped {args.pg_down:.0f} s (fast shutdown)",
                     "down_s": back - stopped, "during": None, **signs}]  # fmt: skip
    finally:
        cluster.remove()


def _counts_when_up(probe: Probe) -> tuple[int, int, int]:
    from django.db import connection

    for _ in range(50):
        try:
            return probe.counts()
        except Exception:
            connection.close()
            time.sleep(0.2)
    raise SystemExit("PostgreSQL did not answer after its restart")


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--redis-down", type=float, default=12.0)
    parser.add_argument("--pg-down", type=float, default=20.0)
    parser.add_argument("--limit", type=float, default=180.0, help="give up on a sign after")
    parser.add_argument("--child", choices=("redis", "postgres"))
    args = parser.parse_args()
    if args.child:
        rows = child_redis(args) if args.child == "redis" else child_postgres(args)
        print("RESULT " + json.dumps(rows))
        return
    rows = []
    for scenario in ("redis", "postgres"):
        argv = [sys.executable, __file__, "--child", scenario, "--slots", str(args.slots),
                "--redis-down", str(args.redis_down), "--pg-down", str(args.pg_down),
                "--limit", str(args.limit)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(f"{scenario}: failed ({done.returncode})\n{done.stderr[-3000:]}")
            continue
        rows += json.loads(lines[-1][len("RESULT ") :])
    print(f"\n{args.slots} env slots, shipped policy, default lease/watchdog/retry settings; "
          "seconds after the service was back\n")  # fmt: skip
    print("| outage | down (s) | steps recorded while down | Celery round trip | "
          "all leases held | first step | first episode | first update |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        during = "—" if r["during"] is None else r["during"]
        print(f"| {r['what']} | {r['down_s']:.1f} | {during} | {_fmt(r['celery'])} | "
              f"{_fmt(r['leases'])} | {_fmt(r['step'])} | {_fmt(r['episode'])} | "
              f"{_fmt(r['update'])} |")  # fmt: skip


if __name__ == "__main__":
    main()
