"""Decoupled (DART) versus synchronous batch loop, same machine, slots, policy and tasks.

    .venv/bin/python bench/efficiency.py --minutes 3 --slots 4 --latency osworld --scale 0.1

Starts a private stack (embedded Redis, SQLite under a temporary DARTBOARD_HOME, one solo
Celery env worker per slot, a trainer worker, inference workers behind the router), runs
each mode for the same wall time, and reads the figures back from the database:

- environment utilisation: share of slot time spent in reset/step/evaluate, injected
  latency included, over slots x wall time: each env worker's busy clock (envmanager.busy,
  the call under way included, stored by the slot heartbeat every second) read before and
  after the window. For comparison, the lower bound from finished trajectories' env time
  plus the recorded steps of episodes still running is printed too;
- inference utilisation: the inference workers' busy time (from their /health) over
  workers x wall time;
- trainer utilisation: update time over wall time;
- actions trained per minute (online steps in the batches of the updates made in the window)
  and trajectories per minute;
  beside them the actions recorded per minute and those of them left out as stale.

Modes: `decoupled` (DART), `synchronous` (the batch step loop DART compares against: a
round's episodes take their turns together, `sync_lockstep`), `synchronous-rounds` (the same
rounds without the per-turn lockstep: only each round's end waits for its slowest episode).

`--latency osworld` makes resets take 20-60 s and steps 2-5 s (times `--scale`), the
OSWorld-like setting the targets are stated for. Writes bench/results/efficiency.html.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stack import PrivateStack  # noqa: E402
from envmanager.miniwob_tasks import STARTER_TASKS  # noqa: E402


def call_command(*args, **kwargs):
    from django.core.management import call_command as django_call

    return django_call(*args, **kwargs)


def _health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
        return json.loads(r.read())


def _busy_seconds(worker_urls: list[str]) -> float:
    total = 0.0
    for url in worker_urls:
        with contextlib.suppress(OSError):
            total += float(_health(url).get("busy_seconds", 0.0))
    return total


MODES = {
    "decoupled": {"mode": "decoupled"},
    "synchronous": {"mode": "synchronous", "sync_lockstep": True},
    "synchronous-rounds": {"mode": "synchronous", "sync_lockstep": False},
}


def _env_busy() -> dict[str, float]:
    """Busy seconds per env slot row (each row counts the time it was served)."""
    from datamanager.models import EnvSlot

    return dict(EnvSlot.objects.values_list("name", "env_busy_s"))


def measure(mode: str, *, minutes: float, slots: int, workers: list[str], policy: str) -> dict:
    from django.db.models import Sum

    from datamanager.config import RunConfig
    from datamanager.models import Run, Step, TrainUpdate, Trajectory
    from datamanager.selectors.flow import step_flow
    from datamanager.services.run_workers import run_start_workers
    from datamanager.services.runs import run_control, run_create

    cfg = RunConfig.from_dict(
        {
            **MODES[mode],
            "policy": policy,
            "tasks": {"names": [f"miniwob/{t}" for t in STARTER_TASKS]},
            "env": {"miniwob_slots": slots, "step_timeout_s": 600, "heartbeat_s": 1.0},
            # Episodes run to their step cap (the untrained policy rarely parses), and the caps
            # are heavy-tailed per task (set below), like OSWorld's trajectory lengths.
            "rollout": {"max_new_tokens": 32, "request_timeout_s": 300, "max_parse_errors": 15},
            "curation": {"n_max": 4, "n_min": 2, "dynamic_step_cap": False},
            "trainer": {"min_groups": 2, "kl_coef": 0.0, "micro_batch": 8},
        }
    )
    run = run_create(name=f"bench {mode}", config=cfg)
    busy0 = _busy_seconds(workers)
    env_busy0 = _env_busy()
    run_control(run_id=run.pk, action="start")
    run_start_workers(run_id=run.pk)
    started = time.monotonic()
    t0 = Run.objects.get(pk=run.pk).started_at
    time.sleep(minutes * 60)
    wall = time.monotonic() - started
    busy = _busy_seconds(workers) - busy0
    env_busy = sum(b - env_busy0.get(name, 0.0) for name, b in _env_busy().items())
    run_control(run_id=run.pk, action="stop")
    finished = Trajectory.objects.filter(
        run=run, finished_at__isnull=False, finished_at__lte=t0 + _td(wall)
    )
    env_ms = finished.aggregate(s=Sum("env_ms"))["s"] or 0.0
    # The cross-check from the trajectories: episodes still running at the end of the window
    # count with the steps they recorded in it (a lower bound: their reset and the step
    # under way are not known yet).
    in_flight = Step.objects.filter(trajectory__run=run, created_at__lte=t0 + _td(wall)).exclude(
        trajectory__in=finished
    )
    env_ms += in_flight.aggregate(s=Sum("env_ms"))["s"] or 0.0
    updates = [u for u in TrainUpdate.objects.filter(run=run) if u.created_at <= t0 + _td(wall)]
    trained = Step.objects.filter(trajectory__run=run, trained_in_update__in=updates).count()
    # Where the recorded actions that were not trained went: left out as stale (older than
    # current - k when their group reached the trainer) or still waiting at the end.
    recorded = Step.objects.filter(trajectory__run=run, created_at__lte=t0 + _td(wall))
    stale = recorded.filter(stale=True).count()
    # The fates of the window's online steps, as the run page shows them.
    flow = step_flow(run=run, start=t0, end=t0 + _td(wall))
    train_s = sum(u.metrics.get("duration_s", 0.0) for u in updates)
    return {
        "mode": mode,
        "wall_s": wall,
        "env_util": env_busy / (slots * wall),
        "env_util_lower_bound": env_ms / 1000.0 / (slots * wall),
        "inference_util": busy / (len(workers) * wall) if busy else None,
        "trainer_util": train_s / wall,
        "actions_trained_per_min": trained / (wall / 60),
        "actions_recorded_per_min": recorded.count() / (wall / 60),
        "actions_stale_per_min": stale / (wall / 60),
        "trajectories_per_min": finished.count() / (wall / 60),
        "trained_share": flow.share("trained"),
        "chosen_share": flow.chosen_share,
        "stale_share": flow.share("stale"),
        "updates": len(updates),
    }


def heavy_tailed_step_budgets() -> None:
    """OSWorld-like trajectory lengths: each bench task declares a Pareto-distributed step
    budget (seeded, so both modes see the same), 2 to 15 steps."""
    from datamanager.models import Task

    rng = random.Random(0)
    for name in STARTER_TASKS:
        task = Task.objects.get(name=f"miniwob/{name}")
        task.env_config = {
            **task.env_config,
            "max_steps": min(15, max(2, round(2 * rng.paretovariate(1.2)))),
        }
        task.save(update_fields=["env_config"])


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--inference-workers", type=int, default=1)
    parser.add_argument("--latency", default="osworld", choices=["off", "osworld"])
    parser.add_argument("--scale", type=float, default=0.1, help="multiplies the injected latency")
    parser.add_argument("--modes", default="decoupled,synchronous,synchronous-rounds")
    parser.add_argument("--home", type=Path, default=None)
    args = parser.parse_args()

    env = {"DARTBOARD_ENV_LATENCY": args.latency, "DARTBOARD_ENV_LATENCY_SCALE": str(args.scale)}
    results = []
    with PrivateStack(
        slots=args.slots, inference_workers=args.inference_workers, env=env, home=args.home
    ) as stack:
        heavy_tailed_step_budgets()
        # Pool successes join all-failed groups, so updates carry a gradient (an untrained
        # policy alone fails everything and every group would be skipped).
        # Collected here in the bench process, without the injected latency (the workers
        # have it): demos are set-up, not part of either mode's measured time.
        from django.test import override_settings

        with override_settings(DARTBOARD_ENV_LATENCY="off"):
            call_command(
                "collect_demos", per_task=2, tasks=",".join(f"miniwob/{t}" for t in STARTER_TASKS)
            )
        modes = args.modes.split(",")
        unknown = sorted(set(modes) - set(MODES))
        if unknown:
            parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
        for mode in modes:
            print(f"measuring {mode} for {args.minutes} min ...", flush=True)
            results.append(
                measure(
                    mode,
                    minutes=args.minutes,
                    slots=args.slots,
                    workers=stack.workers,
                    policy=stack.policy,
                )
            )
            time.sleep(10)  # let the stopped run's last episodes drain
    print_table(results, args)
    write_figure(results)


def _fmt(key: str, v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.1%}" if "util" in key or "share" in key else f"{v:.1f}"


def print_table(results: list[dict], args) -> None:
    """One column per mode; each synchronous mode also gets a decoupled/that-mode ratio."""
    keys = [
        ("env_util", "environment utilisation"),
        ("env_util_lower_bound", "  (lower bound from trajectories)"),
        ("inference_util", "inference utilisation"),
        ("trainer_util", "trainer utilisation"),
        ("actions_trained_per_min", "actions trained / min"),
        ("actions_recorded_per_min", "  (actions recorded / min)"),
        ("actions_stale_per_min", "  (of those left out as stale / min)"),
        ("trajectories_per_min", "trajectories / min"),
        ("trained_share", "settled online steps trained"),
        ("chosen_share", "  (trained or left out by the entropy selection)"),
        ("stale_share", "  (left out as stale)"),
    ]
    by = {r["mode"]: r for r in results}
    modes = [r["mode"] for r in results]
    baselines = [m for m in modes if m != "decoupled"] if "decoupled" in by else []
    header = ["metric", *modes, *(f"decoupled / {m}" for m in baselines)]
    print(f"\nslots={args.slots} latency={args.latency} scale={args.scale} minutes={args.minutes}")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for key, label in keys:
        cells = [_fmt(key, by[m].get(key)) for m in modes]
        d = by.get("decoupled", {}).get(key)
        for m in baselines:
            s = by[m].get(key)
            cells.append(f"{d / s:.2f}x" if d and s else "n/a")
        print(f"| {label} | " + " | ".join(cells) + " |")


def write_figure(results: list[dict]) -> None:
    import plotly.graph_objects as go

    metrics = ["env_util", "inference_util", "trainer_util"]
    fig = go.Figure(
        [go.Bar(name=r["mode"], x=metrics, y=[r.get(m) or 0 for m in metrics]) for r in results]
    )
    fig.update_layout(
        title="Decoupled vs synchronous: utilisation", yaxis_tickformat=".0%", barmode="group"
    )
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    fig.write_html(out / "efficiency.html", include_plotlyjs=True)
    (out / "efficiency.json").write_text(json.dumps(results, indent=2))
    print(f"figure: {out / 'efficiency.html'}")


if __name__ == "__main__":
    main()
