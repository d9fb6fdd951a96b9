"""One load of bench/scale.py: N simulated slots on one run, measured over a sustain window.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/NAME REDIS_URL=unix:///.../redis.sock \\
    DARTBOARD_HOME=/tmp/x .venv/bin/python -m bench.scale_load --slots 100 --minutes 2 --out r.json

Sets up a fresh database (migrate, the built-in sim tasks, one running run of the scripted
oracle on `sim/click-8` .. `sim/click-12`), starts `--processes` driver processes
(bench/scale_slots.py) that share the N slots, and meanwhile, in this process:
- runs the watchdog's pass (workers.watchdog.watchdog_pass) every 15 s, timing it;
- consumes the ready groups as the trainer's batch collection does
  (datamanager.services.batches.batch_collect; the gradient step is left out) and marks
  them trained;
- samples the database (rows, pg_database_size), Redis (commands processed, by command),
  the media folder and its own CPU at the start and end of the sustain window (after
  `--warmup-s`);
- holds `--viewers` sockets (default 2) on the real consumer (dartboard/consumers.py)
  through the window: page 1 of the env wall, an unpaged wall, then run pages and further
  wall pages in turn; counts the events each is sent per second and the Redis round trips
  their own connections send. Before they connect, a control interval of CONTROL_S at the
  same load gives Redis's commands per step without them, to set beside the window's.

After the window the slots finish the episodes under way; then it checks that nothing was
lost (every step a slot recorded is a row, every trajectory ended, each trajectory's length
equals its step rows) and writes the figures to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")  # /proc's CPU times are in these
TASKS = [f"sim/click-{k}" for k in range(8, 13)]  # 8-12 clicks: ~10 steps an episode


def _setup(n: int) -> int:
    from django.core.management import call_command
    from django.utils import timezone

    from datamanager.config import RunConfig
    from datamanager.models import Run, RunStatus
    from datamanager.services.episodes import taskstats_ensure
    from datamanager.services.runs import tasks_import
    from datamanager.task_import import parse_task_record
    from envmanager.sim_env import sim_task_records

    call_command("migrate", verbosity=0)
    tasks_import(records=[parse_task_record(r, "sim") for r in sim_task_records()])
    cfg = RunConfig.from_dict(
        {
            "policy": "oracle",
            # A training run's fixed instances (seeds): 5 tasks x 32 seeds x ~11 screens
            # stay in the sim backend's screen cache, so the stand-in draws and encodes a
            # screen once, not every step (each step's PNG is still stored).
            "tasks": {"env_kinds": ["sim"], "names": TASKS, "instances": 32},
            "env": {"miniwob_slots": 0, "sim_slots": n},
        }
    )
    run = Run.objects.create(
        name=f"scale {n} sim slots",
        config=cfg.to_dict(),
        status=RunStatus.RUNNING,
        started_at=timezone.now(),
    )
    taskstats_ensure(run=run)
    return run.pk


def _process_cpu_jiffies(match: Callable[[str, str], bool]) -> float:
    """utime + stime (+ its ended children's), in clock ticks, of every process whose (comm,
    cmdline) `match` accepts."""
    total = 0.0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        if match(comm, cmdline):
            fields = stat[stat.rindex(")") + 2 :].split()
            # utime, stime, and cutime, cstime: the CPU of its children that ended (the
            # postmaster's: backends and autovacuum workers that exited in the window)
            total += sum(float(f) for f in fields[11:15])
    return total


# Seconds of the control interval (Redis commands without the viewers) and of the viewers'
# connecting (their subscriptions) before the window.
CONTROL_S = 60.0
SETTLE_S = 5.0


def _own_cpu_s() -> float:
    """This process's CPU: the watchdog, the trainer's batch collection, the viewers' web."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _redis_ops_per_step(before: dict[str, Any], after: dict[str, Any]) -> float:
    return (after["redis_commands"] - before["redis_commands"]) / max(
        1, after["steps"] - before["steps"]
    )


def _sample(media: Path) -> dict[str, Any]:
    from django.db import connection

    from datamanager.live_work import redis_client
    from datamanager.models import Step, Trajectory

    with connection.cursor() as cur:
        cur.execute("SELECT pg_database_size(current_database())")
        db_bytes = cur.fetchone()[0]
        cur.execute("SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables")
        rows_inserted = cur.fetchone()[0]
    client = redis_client()
    try:
        commands = client.info("stats")["total_commands_processed"]
        by_command = {k.removeprefix("cmdstat_"): v["calls"] for k, v in client.info("commandstats").items()}  # fmt: skip
    finally:
        client.close()
    media_bytes = sum(p.stat().st_size for p in media.rglob("*") if p.is_file())
    # The machine's CPU (every process, the other users of the 2 cores included).
    cpu = [float(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    # The services' own: every PostgreSQL process (backends, WAL writer, checkpointer; the
    # server is this machine's, idle but for the bench) and this bench's embedded Redis.
    socket_path = os.environ.get("REDIS_URL", "").removeprefix("unix://").split("?")[0]
    pg_cpu = _process_cpu_jiffies(
        lambda comm, cmd: comm == "postgres" or cmd.startswith("postgres:")
    )
    redis_cpu = _process_cpu_jiffies(
        lambda comm, cmd: "redis-server" in cmd and bool(socket_path) and socket_path in cmd
    )
    return {
        "t": time.time(),
        "steps": Step.objects.count(),
        "trajectories": Trajectory.objects.count(),
        "db_bytes": float(db_bytes),
        "rows_inserted": float(rows_inserted),
        "redis_commands": float(commands),
        "redis_by_command": by_command,
        "media_bytes": float(media_bytes),
        "cpu_busy": sum(cpu) - cpu[3] - cpu[4],  # all but idle and iowait, in jiffies
        "cpu_all": sum(cpu),
        "pg_cpu": pg_cpu,
        "redis_cpu": redis_cpu,
    }


@contextlib.contextmanager
def _round_trips_counted(window_start: float, until: float) -> Iterator[list[int]]:
    """Counts the Redis round trips (a command, or a pipeline) that asyncio Redis clients on
    this thread send within the window: the viewers' channel layer, which no other code of
    this process runs on the viewers' thread (the events publisher has a thread of its own)."""
    from redis.asyncio.connection import AbstractConnection

    counted, me, real = [0], threading.get_ident(), AbstractConnection.send_packed_command

    async def send(conn: Any, command: Any, check_health: bool = True) -> None:
        if threading.get_ident() == me and window_start <= time.time() <= until:
            counted[0] += 1
        await real(conn, command, check_health)

    AbstractConnection.send_packed_command = send  # type: ignore[method-assign,assignment]
    try:
        yield counted
    finally:
        AbstractConnection.send_packed_command = real  # type: ignore[method-assign]


class Background:
    """The watchdog passes and the trainer's batch collection, each on its own thread."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        self.stop = threading.Event()
        self.watchdog_ms: list[float] = []
        self.watchdog_restarted: list[str] = []
        self.collect_ms: list[float] = []
        self.groups_consumed = 0
        self.samples_built = 0
        self.viewer_events_per_s: dict[str, list[float]] = {}
        self.viewer_round_trips: int | None = None
        self.errors: list[str] = []

    def watchdog(self) -> None:
        from django.db import connection

        from workers.watchdog import watchdog_pass

        try:
            while not self.stop.wait(15.0):
                started = time.perf_counter()
                self.watchdog_restarted += watchdog_pass()
                self.watchdog_ms.append((time.perf_counter() - started) * 1000)
        except Exception as exc:
            self.errors.append(f"watchdog: {type(exc).__name__}: {exc}")
        finally:
            connection.close()

    def trainer(self) -> None:
        from django.db import connection

        from datamanager.models import GroupStatus, Run, TaskGroup
        from datamanager.services.batches import batch_collect, batch_skip

        try:
            run = Run.objects.get(pk=self.run_id)
            while not self.stop.wait(5.0):
                while True:
                    started = time.perf_counter()
                    batch = batch_collect(run=run, current_version=0, min_groups=1)
                    if batch is None:
                        break
                    batch_skip(batch=batch)
                    TaskGroup.objects.filter(pk__in=batch.group_ids).update(
                        status=GroupStatus.TRAINED
                    )
                    self.collect_ms.append((time.perf_counter() - started) * 1000)
                    self.groups_consumed += len(batch.group_ids)
                    self.samples_built += len(batch.samples)
                    if self.stop.is_set():
                        break
        except Exception as exc:
            self.errors.append(f"trainer: {type(exc).__name__}: {exc}")
        finally:
            connection.close()

    def viewers(self, count: int, connect_at: float, window_start: float, until: float) -> None:
        """`count` live sockets of a logged-in viewer on the real consumer and channel layer,
        in this process (one web process), connected at `connect_at` and open through the
        window: the first on page 1 of the env wall (its tiles' slots), the second on an
        unpaged wall (`?slots=all`), then run pages (the run's own events) and wall pages 2,
        3, ... in turn. Counts the events each is sent in the window."""
        import asyncio

        from channels.testing import WebsocketCommunicator
        from django.contrib.auth import get_user_model
        from django.db import connection

        from dartboard.consumers import RunEventsConsumer
        from dartboard.viewmodels import run_slots
        from datamanager.models import Run
        from datamanager.roles import role_group

        user, _ = get_user_model().objects.get_or_create(username="bench-viewer")
        user.groups.add(role_group("viewer"))
        time.sleep(max(0.0, connect_at - time.time()))
        run = Run.objects.get(pk=self.run_id)
        wall_page = 1
        queries: list[tuple[str, str]] = []  # (what it shows, the socket's query)
        for i in range(count):
            if i == 1:
                queries.append(("unpaged_wall", "slots=all"))
            elif i > 1 and i % 2 == 0:
                queries.append(("run_page", ""))
            else:
                tiles = run_slots(run=run, page=wall_page).tiles  # the page as shown
                queries.append(("wall_page", "slots=" + ",".join(str(t.id) for t in tiles)))
                wall_page += 1
        connection.close()

        async def listen(query: str) -> int:
            comm = WebsocketCommunicator(
                RunEventsConsumer.as_asgi(), f"/ws/runs/{self.run_id}/?{query}"
            )
            comm.scope["user"] = user
            comm.scope["url_route"] = {"kwargs": {"run_id": self.run_id}}
            # On a saturated machine the default second is too short for the page's
            # permission check and its subscriptions.
            connected, _ = await comm.connect(timeout=60)
            if not connected:
                raise RuntimeError(f"the consumer refused the bench's viewer socket ?{query}")
            received = 0
            # Open a little past the window, so that their leaving is not in its last sample.
            while (left := until + SETTLE_S - time.time()) > 0:
                try:  # the queue, not receive_from: its timeout would cancel the consumer
                    await asyncio.wait_for(comm.output_queue.get(), timeout=left)
                    received += window_start <= time.time() <= until
                except TimeoutError:
                    break
            await comm.disconnect()
            return received

        async def all_of_them() -> list[int]:
            return list(await asyncio.gather(*(listen(q) for _, q in queries)))

        try:
            with _round_trips_counted(window_start, until) as round_trips:
                received = asyncio.run(all_of_them())
            self.viewer_round_trips = round_trips[0]
            secs = max(1.0, until - window_start)
            for (shows, _), n in zip(queries, received, strict=True):
                self.viewer_events_per_s.setdefault(shows, []).append(n / secs)
        except Exception as exc:
            self.errors.append(f"viewers: {type(exc).__name__}: {exc}")

    def start(
        self, viewers: int, connect_at: float, window_start: float, until: float
    ) -> list[threading.Thread]:
        threads = [
            threading.Thread(target=self.watchdog, daemon=True),
            threading.Thread(target=self.trainer, daemon=True),
        ]
        if viewers:
            threads.append(
                threading.Thread(
                    target=self.viewers,
                    args=(viewers, connect_at, window_start, until),
                    daemon=True,
                )
            )
        for t in threads:
            t.start()
        return threads


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _check(run_id: int, recorded: int, finished: int) -> dict[str, Any]:
    """Nothing lost: every recorded step is a row, every trajectory ended, lengths agree."""
    from django.db import connection

    from datamanager.models import Step, Trajectory, TrajectoryStatus

    trajs = Trajectory.objects.filter(run_id=run_id)
    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM datamanager_trajectory t WHERE t.run_id = %s AND t.length <> "
            "(SELECT count(*) FROM datamanager_step s WHERE s.trajectory_id = t.id)",
            [run_id],
        )
        length_mismatch = cur.fetchone()[0]
    rows = Step.objects.filter(trajectory__run_id=run_id).count()
    return {
        "steps_recorded_by_slots": recorded,
        "step_rows": rows,
        "trajectories_finished_by_slots": finished,
        "trajectories": trajs.count(),
        "still_running": trajs.filter(status=TrajectoryStatus.RUNNING).count(),
        "not_succeeded": trajs.exclude(status=TrajectoryStatus.SUCCEEDED).count(),
        "length_mismatch": length_mismatch,
        "nothing_lost": rows == recorded
        and trajs.count() == finished
        and not trajs.filter(status=TrajectoryStatus.RUNNING).exists()
        and length_mismatch == 0,
    }


def main() -> None:
    """Long because it is the bench's steps in order."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--minutes", type=float, default=10.0, help="sustain window")
    ap.add_argument("--warmup-s", type=float, default=None, help="default: the longest reset")
    ap.add_argument("--latency-scale", type=float, default=0.45)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--pool", type=int, default=6, help="database connections per process")
    ap.add_argument("--batch-steps", type=int, default=0, help="0: one transaction a step")
    ap.add_argument("--switch-ms", type=float, default=5.0, help="driver thread switch interval")
    ap.add_argument("--viewers", type=int, default=2, help="live sockets open in the window")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
    import django

    django.setup()
    from django.conf import settings

    from envmanager.latency import PROFILES

    run_id = _setup(args.slots)
    profile = PROFILES["osworld"].scaled(args.latency_scale)
    warmup = args.warmup_s if args.warmup_s is not None else profile.reset_s[1] + 15
    t0 = time.time()
    # With viewers, a control interval before they connect: the Redis commands per step
    # without them, at the same load (one run, so the difference is the viewers').
    control_start = t0 + warmup
    connect_at = control_start + (CONTROL_S if args.viewers else 0.0)
    window_start = connect_at + (SETTLE_S if args.viewers else 0.0)
    until = window_start + args.minutes * 60
    outs = [args.out.with_suffix(f".p{i}.json") for i in range(args.processes)]
    per = [args.slots // args.processes + (i < args.slots % args.processes) for i in range(args.processes)]  # fmt: skip
    procs, first = [], 0
    for i, count in enumerate(per):
        cmd = [sys.executable, "-m", "bench.scale_slots", "--run", str(run_id),
               "--first", str(first), "--count", str(count), "--until", str(until),
               "--latency-scale", str(args.latency_scale), "--pool", str(args.pool),
               "--batch-steps", str(args.batch_steps), "--switch-ms", str(args.switch_ms),
               "--out", str(outs[i])]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=ROOT))
        first += count
    background = Background(run_id)
    threads = background.start(args.viewers, connect_at, window_start, until)
    media = Path(settings.MEDIA_ROOT)
    control = []
    if args.viewers:
        time.sleep(max(0.0, control_start - time.time()))
        control.append(_sample(media))
        time.sleep(max(0.0, connect_at - time.time()))
        control.append(_sample(media))
    time.sleep(max(0.0, window_start - time.time()))
    start = _sample(media)
    load_cpu_start = _own_cpu_s()
    time.sleep(max(0.0, until - time.time()))
    load_cpu_end = _own_cpu_s()
    end = _sample(media)
    drain_started = time.time()
    for p in procs:
        p.wait()
    drain_s = time.time() - drain_started
    background.stop.set()
    for t in threads:
        t.join(timeout=120)
    results = [json.loads(o.read_text()) for o in outs]
    counts = {k: sum(r["counts"][k] for r in results) for k in results[0]["counts"]}

    def window(kind: str) -> list[float]:
        return [ms for r in results for t, ms in r["timings"].get(kind, []) if start["t"] <= t <= end["t"]]  # fmt: skip

    secs = end["t"] - start["t"]
    hour = 3600 / secs
    record, claim = window("step_record"), window("claim")
    summary = {
        "slots": args.slots,
        "processes": args.processes,
        "pool": args.pool,
        "batch_steps": args.batch_steps,
        "switch_ms": args.switch_ms,
        "mean_step_batch": statistics.fmean(b)
        if (b := [n for r in results for n in r["step_batches"]])
        else 1.0,
        "latency_scale": args.latency_scale,
        "window_s": secs,
        "warmup_s": warmup,
        "drain_s": drain_s,
        "steps_per_s": (end["steps"] - start["steps"]) / secs,
        "trajectories_per_s": (end["trajectories"] - start["trajectories"]) / secs,
        "step_record_ms": {"n": len(record), "p50": _pct(record, 50), "p99": _pct(record, 99)},
        "claim_ms": {"n": len(claim), "p50": _pct(claim, 50), "p99": _pct(claim, 99)},
        "step_record_service_ms": {
            "p50": _pct(service := window("step_record_service"), 50),
            "p99": _pct(service, 99),
        },
        "driver_cpu_ms_per_step": 1000 * sum(r["cpu_s"] for r in results) / max(1, counts["steps"]),
        # Per step recorded in the window: what the platform costs apart from its stand-in.
        # The Dartboard code on the step path runs inside the driver processes (their pool,
        # writer and heartbeat threads); the stand-in is the rest of the driver's CPU.
        "platform_code_cpu_ms_per_step": 1000
        * sum(r["platform_cpu_s"] for r in results)
        / max(1, counts["steps"]),
        "postgres_cpu_ms_per_step": 1000
        * (end["pg_cpu"] - start["pg_cpu"])
        / TICKS
        / max(1, end["steps"] - start["steps"]),
        "redis_cpu_ms_per_step": 1000
        * (end["redis_cpu"] - start["redis_cpu"])
        / TICKS
        / max(1, end["steps"] - start["steps"]),
        "machine_cpu_busy": (end["cpu_busy"] - start["cpu_busy"])
        / max(1.0, end["cpu_all"] - start["cpu_all"]),
        "finish_ms_p99": _pct(window("finish"), 99),
        # The same calls apart: the driver's pool queue (the stand-in's) and the time on a
        # pool thread (the platform's call, with the driver's GIL waits in it).
        "pool_wait_ms": {"p50": _pct(wait := window("pool_wait"), 50), "p99": _pct(wait, 99)},
        "claim_service_ms": {
            "p50": _pct(claim_svc := window("claim_service"), 50),
            "p99": _pct(claim_svc, 99),
        },
        "finish_service_ms_p99": _pct(window("finish_service"), 99),
        "heartbeat_service_ms_max": max(window("heartbeat_service"), default=None),
        "db_rows_per_hour": (end["rows_inserted"] - start["rows_inserted"]) * hour,
        "db_bytes_per_hour": (end["db_bytes"] - start["db_bytes"]) * hour,
        "media_bytes_per_hour": (end["media_bytes"] - start["media_bytes"]) * hour,
        "redis_ops_per_s": (end["redis_commands"] - start["redis_commands"]) / secs,
        "watchdog_ms": {
            "passes": len(background.watchdog_ms),
            "p50": _pct(background.watchdog_ms, 50),
            "max": max(background.watchdog_ms, default=None),
        },
        "watchdog_restarted": background.watchdog_restarted[:10],
        "batch_collect": {
            "batches": len(background.collect_ms),
            "groups": background.groups_consumed,
            "samples": background.samples_built,
            "p50_ms": _pct(background.collect_ms, 50),
        },
        "heartbeat_ms_max": max((ms for r in results for ms in r["beat_ms"]), default=None),
        "lost_leases": sum(r["lost_leases"] for r in results),
        "slot_errors": counts["errors"],
        "viewers": args.viewers,
        "viewer_events_per_s": background.viewer_events_per_s,
        # What a watching browser costs Redis: the round trips the viewers' own connections
        # sent in the window, per viewer and second; and Redis's commands per step with the
        # viewers (the window) and without them (the control interval), whoever sent them.
        "redis_round_trips_per_s_per_viewer": (
            background.viewer_round_trips / secs / args.viewers
            if background.viewer_round_trips is not None
            else None
        ),
        "redis_ops_per_step": _redis_ops_per_step(start, end),
        "redis_ops_per_step_without_viewers": _redis_ops_per_step(*control) if control else None,
        "redis_commands_per_s": {
            k: (n - start["redis_by_command"].get(k, 0)) / secs
            for k, n in sorted(end["redis_by_command"].items(), key=lambda kv: -kv[1])
            if n > start["redis_by_command"].get(k, 0)
        },
        # The platform's CPU outside the driver, per step: this process (watchdog, batch
        # collection, the viewers' consumer: a web process's part), PostgreSQL and Redis.
        "load_process_cpu_ms_per_step": 1000
        * (load_cpu_end - load_cpu_start)
        / max(1, end["steps"] - start["steps"]),
        "errors": [e for r in results for e in r["errors"]][:3] + background.errors,
        "check": _check(run_id, counts["steps"], counts["finished"]),
    }
    args.out.write_text(json.dumps(summary, indent=2))
    for o in outs:
        o.unlink()
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
