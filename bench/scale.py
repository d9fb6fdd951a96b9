"""The control plane at 100, 300 and 1,000 environments, on PostgreSQL (issue 19, item 4).

    .venv/bin/python bench/scale.py [--slots 100 300 1000] [--minutes 10] [--latency-scale 0.45]
        [--viewers 2] [--pages-steps 1000000] [--skip-pages]
        [--pg postgres://postgres@127.0.0.1:5432] [--json bench/results/scale.json]

For each N, a fresh PostgreSQL database and a private embedded Redis (a unix socket): N
simulated slots (the `sim` backend at OSWorld latency times --latency-scale, the scripted
oracle) in a few driver processes run against the real services for a sustain window of
--minutes (bench/scale_load.py, bench/scale_slots.py). Printed per N: steps per second
sustained; p50 and p99 of a step record and of a claim as the slot waits for them; database
rows and bytes per hour (and the screenshots' bytes); Redis commands per second; the
watchdog's pass time; the trainer's batch collection; whether anything was lost; and per
step the CPU time of PostgreSQL's processes, of the Redis, and of the platform's own code in
the driver (its database pool, step writer and heartbeat threads) apart from the stand-in
slots' (the rest of the driver's CPU), and of the load process (the watchdog, the batch
collection and the viewers' consumer: the web's part); and, with --viewers N live sockets
(page 1 of the env wall, an unpaged wall, then run pages and wall pages in turn), the Redis
round trips a second each viewer's own connections send, Redis's commands per step with and
without the viewers (the window against a control interval before they connect) and the
events a second each kind of page is sent.

Then the dashboard pages on a database of --pages-steps recorded steps and 1,000 env slots,
filled with bulk inserts (bench/scale_pages.py).

At OSWorld pace (scale 1) an episode of ~10 steps takes ~75 s, so 1,000 slots record ~133
steps/s; the default scale 0.45 compresses the latencies to reach the issue's ~300 steps/s.
Each database is dropped at the end (--keep keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _psql(pg: str, sql: str) -> None:
    subprocess.run(["psql", f"{pg}/postgres", "-qtAc", sql], check=True)


def _env(pg: str, db: str, home: Path, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DARTBOARD_ENV", None)
    env.update(
        {
            "DATABASE_URL": f"{pg}/{db}",
            "REDIS_URL": redis_url,
            "DARTBOARD_HOME": str(home),
            "DJANGO_SETTINGS_MODULE": "dartboard.settings",
        }
    )
    return env


def _one(args: argparse.Namespace, what: list[str], db: str, out: Path) -> dict[str, Any]:
    """Run a bench module on a fresh database and its own Redis; returns its JSON."""
    from hostagent.embedded_redis import EmbeddedRedis

    _psql(args.pg, f"DROP DATABASE IF EXISTS {db}")
    _psql(args.pg, f"CREATE DATABASE {db}")
    home = Path(tempfile.mkdtemp(prefix=f"{db}-"))
    try:
        with EmbeddedRedis(home / "redis" / "redis.sock", persist=False) as redis:
            env = _env(args.pg, db, home, redis.url)
            subprocess.run([sys.executable, "-m", *what, "--out", str(out)], cwd=ROOT, env=env,
                           check=True)  # fmt: skip
        return json.loads(out.read_text())
    finally:
        if not args.keep:
            _psql(args.pg, f"DROP DATABASE IF EXISTS {db}")
            subprocess.run(["rm", "-rf", str(home)], check=False)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def load_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| slots | steps/s | step record p50 / p99 (ms) | claim p50 / p99 (ms) | DB rows/h | "
        "DB MB/h | screenshots MB/h | Redis ops/s | watchdog pass p50 / max (ms) | "
        "batches (groups) | nothing lost |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        c = r["check"]
        lost = "yes" if c["nothing_lost"] else (
            f"NO: {c['step_rows']}/{c['steps_recorded_by_slots']} steps, "
            f"{c['still_running']} running, {c['length_mismatch']} lengths off")  # fmt: skip
        out.append(
            f"| {r['slots']} | {r['steps_per_s']:.1f} | {_ms(r['step_record_ms']['p50'])} / "
            f"{_ms(r['step_record_ms']['p99'])} | {_ms(r['claim_ms']['p50'])} / "
            f"{_ms(r['claim_ms']['p99'])} | {r['db_rows_per_hour']:,.0f} | "
            f"{r['db_bytes_per_hour'] / 1e6:,.0f} | {r['media_bytes_per_hour'] / 1e6:,.0f} | "
            f"{r['redis_ops_per_s']:,.0f} | {_ms(r['watchdog_ms']['p50'])} / "
            f"{_ms(r['watchdog_ms']['max'])} | {r['batch_collect']['batches']} "
            f"({r['batch_collect']['groups']}) | {lost} |"
        )
    return "\n".join(out)


def detail_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| slots | driver processes x DB pool | steps a transaction | "
        "step record on the DB thread p50 / p99 (ms) | "
        "finish p99 (ms) | driver CPU per step (ms) | of it the platform's code (ms) | "
        "PostgreSQL CPU per step (ms) | Redis CPU per step (ms) | machine CPU busy | "
        "heartbeat batch max (ms) | batch collect p50 (ms) | trajectories | drain (s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        svc = r["step_record_service_ms"]
        batching = f"{r['mean_step_batch']:.1f}" if r["batch_steps"] else "1 (step_record)"
        out.append(
            f"| {r['slots']} | {r['processes']} x {r['pool']}, switch "
            f"{r.get('switch_ms', 5.0):g} ms | {batching} | {_ms(svc['p50'])} / "
            f"{_ms(svc['p99'])} | {_ms(r['finish_ms_p99'])} | "
            f"{r['driver_cpu_ms_per_step']:.1f} | {_ms(r.get('platform_code_cpu_ms_per_step'))} | "
            f"{_ms(r.get('postgres_cpu_ms_per_step'))} | {_ms(r.get('redis_cpu_ms_per_step'))} | "
            f"{r['machine_cpu_busy']:.0%} | "
            f"{_ms(r['heartbeat_ms_max'])} | {_ms(r['batch_collect']['p50_ms'])} | "
            f"{r['check']['trajectories']:,} | {r['drain_s']:.0f} |"
        )
    return "\n".join(out)


def split_table(rows: list[dict[str, Any]]) -> str:
    """Where a call's time goes: the driver's pool queue (the stand-in's) and the call on a
    pool thread (the platform's, with the driver's GIL waits in it)."""
    out = [
        "| slots | claim as the slot waits p50 / p99 (ms) | pool queue p50 / p99 (ms) | "
        "claim on the pool thread p50 / p99 (ms) | finish as waited / on the pool thread "
        "p99 (ms) | heartbeat batch / its statement on the pool thread, max (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "pool_wait_ms" not in r:
            continue  # measured before the split
        wait, svc = r["pool_wait_ms"], r["claim_service_ms"]
        out.append(
            f"| {r['slots']} | {_ms(r['claim_ms']['p50'])} / {_ms(r['claim_ms']['p99'])} | "
            f"{_ms(wait['p50'])} / {_ms(wait['p99'])} | {_ms(svc['p50'])} / {_ms(svc['p99'])} | "
            f"{_ms(r['finish_ms_p99'])} / {_ms(r['finish_service_ms_p99'])} | "
            f"{_ms(r['heartbeat_ms_max'])} / {_ms(r['heartbeat_service_ms_max'])} |"
        )
    return "\n".join(out)


def _print_errors(result: dict[str, Any]) -> None:
    """Slots that died or episodes that ended early, and the load's own errors: a row with
    them measured fewer slots than it says (the JSON keeps the first tracebacks)."""
    if result["slot_errors"] or result["errors"]:
        last = [e.strip().splitlines()[-1] for e in result["errors"]]
        print(
            f"N={result['slots']}: {result['slot_errors']} slot or episode errors; "
            f"last lines: {last[:3]}",
            file=sys.stderr,
            flush=True,
        )


def _mean(values: list[float] | None) -> str:
    return "-" if not values else f"{sum(values) / len(values):.1f}"


def viewers_table(rows: list[dict[str, Any]]) -> str:
    """What the live sockets cost and get: Redis round trips a second per viewer (its own
    connections'), Redis commands per step with and without them (the window against the
    control interval, whoever sent them), the events a second each kind of page is sent (mean
    over its sockets), and the CPU per step of the load process (its viewers are a web
    process's part)."""
    out = [
        "| slots | viewers | steps/s | Redis round trips/s per viewer | Redis ops per step, with / "
        "without viewers | events/s to a wall page / an unpaged wall / a run page | "
        "load process CPU per step (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ev = r.get("viewer_events_per_s") or {}
        per_viewer = r.get("redis_round_trips_per_s_per_viewer")
        without = r.get("redis_ops_per_step_without_viewers")
        out.append(
            f"| {r['slots']} | {r.get('viewers', '-')} | {r['steps_per_s']:.1f} | "
            f"{'-' if per_viewer is None else f'{per_viewer:.1f}'} | "
            f"{r.get('redis_ops_per_step', 0):.1f} / {'-' if without is None else f'{without:.1f}'} | "
            f"{_mean(ev.get('wall_page'))} / {_mean(ev.get('unpaged_wall'))} / "
            f"{_mean(ev.get('run_page'))} | {_ms(r.get('load_process_cpu_ms_per_step'))} |"
        )
    return "\n".join(out)


def pages_table(result: dict[str, Any]) -> str:
    out = [
        f"{result['steps']:,} steps, {result['trajectories']:,} trajectories, "
        f"{result['slots']:,} env slots (filled in {result['fill_s']:.0f} s)",
        "",
        f"| page | URL | median of {result['repeat']} (ms) | size (KiB) |",
        "|---|---|---:|---:|",
    ]
    for label, url, ms, size in result["rows"]:
        out.append(f"| {label} | `{url}` | {ms:.1f} | {size / 1024:.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, nargs="*", default=[100, 300, 1000])
    ap.add_argument("--minutes", type=float, default=10.0, help="sustain window per N")
    ap.add_argument("--latency-scale", type=float, default=0.45)
    ap.add_argument(
        "--processes", type=int, default=0, help="driver processes per N (0: N / 150, 2 to 8)"
    )
    ap.add_argument("--pool", type=int, default=6, help="DB connections per driver process")
    ap.add_argument(
        "--batch-steps", type=int, default=0, help="most steps a transaction (0: one each)"
    )
    ap.add_argument(
        "--switch-ms", type=float, default=5.0, help="driver processes' thread switch interval"
    )
    ap.add_argument("--pages-steps", type=int, default=1_000_000)
    ap.add_argument("--skip-pages", action="store_true")
    ap.add_argument("--pg", default="postgres://postgres@127.0.0.1:5432")
    ap.add_argument("--keep", action="store_true", help="keep the databases")
    ap.add_argument("--json", type=Path, help="also write every N's measurements here")
    ap.add_argument("--viewers", type=int, default=2, help="live sockets open in the window")
    args = ap.parse_args()
    tag = f"dartboard_scale_{os.getpid()}"
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.slots:
            t0 = time.time()
            processes = args.processes or min(8, max(2, n // 150))
            what = ["bench.scale_load", "--slots", str(n), "--minutes", str(args.minutes),
                    "--latency-scale", str(args.latency_scale),
                    "--processes", str(processes), "--pool", str(args.pool),
                    "--batch-steps", str(args.batch_steps), "--switch-ms", str(args.switch_ms),
                    "--viewers", str(args.viewers)]  # fmt: skip
            results.append(_one(args, what, f"{tag}_{n}", Path(tmp) / f"load-{n}.json"))
            print(f"N={n}: {time.time() - t0:.0f} s", flush=True)
            print(load_table(results[-1:]), flush=True)
            _print_errors(results[-1])
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
        if results:
            print(
                f"\n## Load ({args.minutes:g} min sustained, latency scale {args.latency_scale})\n"
            )
            print(load_table(results))
            print()
            print(detail_table(results))
            print()
            print(split_table(results))
            print()
            print(viewers_table(results))
        if not args.skip_pages:
            pages = _one(
                args,
                ["bench.scale_pages", "--steps", str(args.pages_steps)],
                f"{tag}_pages",
                Path(tmp) / "pages.json",
            )
            print("\n## Dashboard pages\n")
            print(pages_table(pages))


if __name__ == "__main__":
    main()
