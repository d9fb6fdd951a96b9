"""One process of bench/scale.py's load driver: many simulated env slots as threads.

    DATABASE_URL=... REDIS_URL=... DARTBOARD_HOME=... \\
        .venv/bin/python -m bench.scale_slots --run 1 --first 0 --count 250 --until EPOCH --out x.json

Each slot is a thread that runs what an env worker runs (workers/slot_worker.py) against the
real services: register its EnvSlot row, take its Redis lease, then claim -> episode through
the slot worker's runner (workers/episode_runner.py; the `sim` backend at OSWorld latency,
scaled, and the scripted oracle through the policy contract) -> a step record with its
screenshot per step -> finish; an episode that ends early counts as an error. It stops claiming at
`--until` and finishes the episode under way (nothing is left running).

A slot sleeps through its env's latency without a database connection: its database calls
go through a pool of `--pool` threads that own the process's connections (1,000 slots with a
connection each would exceed PostgreSQL's max_connections of 100). Heartbeats and lease
renewals are batched: one UPDATE (`env_slots_heartbeat`) and one Redis pipeline
(`leases_renew`) per process and period.

It writes what it measured (claim and step-record latency as the slot waits for them, pool
queueing included; counts) to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class DbPool:
    """A few threads that own database connections; slot threads hand them calls.

    A call's time as its slot waits for it is the pool's queue (the stand-in's: a real env
    worker does not share 6 connections among hundreds of slots) plus its time on a pool
    thread (the platform's call: its Python, the round trips, PostgreSQL; in a driver of
    hundreds of threads also its waits for the GIL). A call given `what` adds both to the
    timings: `pool_wait` and `<what>_service`."""

    def __init__(self, size: int, timings: Timings) -> None:
        self.size = size
        self.timings = timings
        self.executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="db")
        self.cpu_s = 0.0  # CPU time the calls took on their pool threads: the platform's code
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], what: str | None = None) -> T:
        return self.executor.submit(self._timed, fn, what, time.perf_counter()).result()

    def _timed(self, fn: Callable[[], T], what: str | None, submitted: float) -> T:
        if what is not None:
            self.timings.add("pool_wait", submitted)
        started, on_thread = time.thread_time(), time.perf_counter()
        try:
            return fn()
        finally:
            spent = time.thread_time() - started
            with self._lock:
                self.cpu_s += spent
            if what is not None:
                self.timings.add(f"{what}_service", on_thread)

    def close(self) -> None:
        from django.db import connection

        # Each pool thread closes its own connection (Django's are per thread): the barrier
        # holds every thread until all have taken one of the calls.
        barrier = threading.Barrier(self.size)

        def close() -> None:
            connection.close()
            barrier.wait(timeout=30)

        for f in [self.executor.submit(close) for _ in range(self.size)]:
            f.result()
        self.executor.shutdown()


class Timings:
    """(wall time, milliseconds) pairs per kind, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[str, list[tuple[float, float]]] = {}

    def add(self, kind: str, started: float) -> None:
        ms = (time.perf_counter() - started) * 1000
        with self.lock:
            self.rows.setdefault(kind, []).append((time.time(), ms))


class StepWriter(threading.Thread):
    """Writes the steps the process's slots record, many per transaction
    (datamanager.services.steps.steps_store, many steps at once): a slot hands its step over and waits
    until it is committed. With --batch-steps 0 each step is written alone on the pool
    (one step per call, through the episode runner's DbRecorder), as serve_slice does."""

    def __init__(self, timings: Timings, max_batch: int) -> None:
        super().__init__(daemon=True, name="steps")
        self.queue: queue.Queue[tuple[Any, Future[None]] | None] = queue.Queue()
        self.timings = timings
        self.max_batch = max_batch
        self.batches: list[int] = []
        self.cpu_s = 0.0  # this thread's CPU time: the platform's step writes

    def record(self, write: Any) -> None:
        done: Future[None] = Future()
        self.queue.put((write, done))
        done.result()

    def run(self) -> None:
        from django.db import connection

        from datamanager.services.steps import steps_store
        from workers.dbutil import db_retry

        while (first := self.queue.get()) is not None:
            items = [first]
            while len(items) < self.max_batch:
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.queue.put(None)
                    break
                items.append(item)
            writes = [w for w, _ in items]
            started = time.perf_counter()
            try:
                db_retry(
                    lambda attempt, ws=writes: steps_store(writes=ws, resume=attempt > 0),
                    what=f"recording {len(writes)} steps",
                )
            except Exception as exc:
                for _, done in items:
                    done.set_exception(exc)
                continue
            for _ in items:
                self.timings.add("step_record_service", started)
            self.batches.append(len(items))
            for _, done in items:
                done.set_result(None)
        connection.close()
        self.cpu_s = time.thread_time()


class PooledRecorder:
    """The episode runner's DbRecorder, its writes run on the pool (or the step writer) and
    timed as the slot waits."""

    def __init__(self, inner: Any, fleet: Fleet) -> None:
        self.inner, self.pool, self.fleet = inner, fleet.pool, fleet

    def set_instruction(self, instruction: str) -> None:
        self.pool.call(lambda: self.inner.set_instruction(instruction))

    def record_step(self, record: Any) -> None:
        started = time.perf_counter()
        if self.fleet.writer is None:
            self.pool.call(lambda: self._timed(record))
        else:
            from datamanager.services.steps import StepWrite

            self.fleet.writer.record(StepWrite(head=self.inner.head, record=record))
        self.fleet.timings.add("step_record", started)
        self.fleet.count("steps")

    def _timed(self, record: Any) -> None:
        started = time.perf_counter()  # on the pool thread: the write without the queue
        self.inner.record_step(record)
        self.fleet.timings.add("step_record_service", started)


class KeptEnv:
    """A slot's one env, as the episode runner opens it: one that failed is kept (a
    simulated env fails only with the bench's own bug, which the errors list shows)."""

    def __init__(self, env: Any) -> None:
        self.env = env

    def open(self) -> Any:
        return self.env

    def discard(self) -> None:
        pass


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        from datamanager.config import RunConfig
        from datamanager.live_work import redis_client
        from datamanager.models import Run

        self.args = args
        self.timings = Timings()
        self.pool = DbPool(args.pool, self.timings)
        # One client for the process's slot threads: a pool they wait on. redis-py's
        # default pool refuses a connection past 100 (MaxConnectionsError), and 167 slots
        # taking their leases at once lost some slots at start (an env worker process
        # serves one slot and has its own client).
        self.redis = redis_client(blocking_pool=64)
        self.cfg = RunConfig.from_dict(self.pool.call(lambda: Run.objects.get(pk=args.run)).config)
        self.leases: dict[str, str] = {}  # key -> holder
        self.clocks: dict[int, Any] = {}  # slot id -> BusyClock
        self.lock = threading.Lock()
        self.stop_beats = threading.Event()
        self.beats_cpu_s = 0.0
        self.counts: dict[str, int] = {"steps": 0, "claims": 0, "finished": 0, "errors": 0}
        self.errors: list[str] = []
        self.beat_ms: list[float] = []
        self.lost_leases = 0
        self.writer = StepWriter(self.timings, args.batch_steps) if args.batch_steps else None

    def count(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1

    # -- one slot ---------------------------------------------------------------------

    def slot(self, index: int) -> None:
        try:
            self._slot(index)
        except Exception:
            self._error(traceback.format_exc(limit=8))

    def _error(self, text: str) -> None:
        """A slot that died, or an episode that ended early (`error` or `aborted`)."""
        with self.lock:
            self.counts["errors"] += 1
            self.errors.append(text)

    def _finish_on_pool(self, finish: Callable[[], T]) -> T:
        """A trajectory's end, on a database thread, timed as the slot waits for it."""
        started = time.perf_counter()
        try:
            return self.pool.call(finish, "finish")
        finally:
            self.timings.add("finish", started)

    def _slot(self, index: int) -> None:
        from datamanager.live_work import slot_work
        from datamanager.models import SlotStatus
        from datamanager.policies import policy_geometry
        from datamanager.services import env_slots, episodes
        from envmanager.busy import BusyClock, BusyEnv
        from envmanager.latency import PROFILES, LatencyEnv
        from envmanager.oracle_policy import ObservedEnv, OracleEndpoint
        from envmanager.sim_env import SimEnv
        from workers.config_mapping import episode_config
        from workers.dbutil import db_retry
        from workers.episode_runner import DbRecorder, EpisodeEnd, episode_run

        args, cfg, pool = self.args, self.cfg, self.pool
        host = socket.gethostname()
        name = f"{host}:{os.getpid()}:sim:{index}"
        work = slot_work(run_id=args.run, backend="sim", index=index)
        if not self.redis.set(work.lease_key, name, nx=True, ex=60):
            raise RuntimeError(f"lease {work.lease_key} is held by another holder")
        slot = pool.call(
            lambda: env_slots.env_slot_register(
                name=name, host=host, backend="sim", run_id=args.run
            )
        )
        clock = BusyClock()
        with self.lock:
            self.leases[work.lease_key] = name
            self.clocks[slot.pk] = clock
        pool.call(lambda: env_slots.env_slot_set(slot_id=slot.pk, status=SlotStatus.IDLE))
        profile = PROFILES["osworld"].scaled(args.latency_scale)
        sim = LatencyEnv(SimEnv(), profile, seed=index)
        oracle = OracleEndpoint(geometry=policy_geometry("oracle"), coords=cfg.rollout.coords)
        env = ObservedEnv(BusyEnv(sim, clock), oracle)
        while time.time() < args.until:
            started = time.perf_counter()
            # As serve_slice does: a transient database error (a deadlock, a restart) is
            # tried again (workers/dbutil.py), not the end of the slot.
            claim = pool.call(
                partial(
                    db_retry,
                    lambda _: episodes.task_claim(
                        run_id=args.run, slot_id=slot.pk, env_kinds=("sim",)
                    ),
                    what="claiming",
                ),
                "claim",
            )
            self.timings.add("claim", started)
            if claim is None:
                time.sleep(1.0)
                continue
            self.count("claims")
            pool.call(
                partial(
                    env_slots.env_slot_set,
                    slot_id=slot.pk,
                    status=SlotStatus.BUSY,
                    trajectory_id=claim.trajectory_id,
                )
            )
            # The slot worker's episode runner: its trajectory's end runs on the pool.
            outcome = episode_run(
                trajectory_id=claim.trajectory_id,
                task=claim.task,
                env=KeptEnv(env),
                policy=oracle,
                recorder=PooledRecorder(DbRecorder(claim.trajectory_id), self),
                config=episode_config(cfg, step_cap=claim.step_cap, seed=claim.decode_seed),
                db=self._finish_on_pool,
            )
            self.count("finished")
            if outcome.end is EpisodeEnd.RAN:
                pool.call(lambda: env_slots.env_slot_success(slot_id=slot.pk))
            else:
                self._error(f"trajectory {claim.trajectory_id}: {outcome.reason}")
            pool.call(lambda: env_slots.env_slot_set(slot_id=slot.pk, status=SlotStatus.IDLE))
        pool.call(lambda: env_slots.env_slot_set(slot_id=slot.pk, status=SlotStatus.STOPPED))

    # -- the process's heartbeat ------------------------------------------------------

    def beats(self) -> None:
        from datamanager.services import env_slots
        from workers.leases import leases_renew

        while not self.stop_beats.wait(self.cfg.env.heartbeat_s):
            started = time.perf_counter()
            with self.lock:
                leases = dict(self.leases)
                busy = {pk: c.seconds() for pk, c in self.clocks.items()}
            self.lost_leases += len(leases_renew(self.redis, leases, ttl_s=60))
            self.pool.call(partial(env_slots.env_slots_heartbeat, busy_s=busy), "heartbeat")
            self.beat_ms.append((time.perf_counter() - started) * 1000)
        self.beats_cpu_s = time.thread_time()  # lease renewals (Redis client) and batching

    def run(self) -> dict[str, Any]:
        start = resource.getrusage(resource.RUSAGE_SELF)  # imports and set-up before this
        beats = threading.Thread(target=self.beats, name="beats", daemon=True)
        beats.start()
        if self.writer is not None:
            self.writer.start()
        threads = []
        for i in range(self.args.count):
            t = threading.Thread(target=self.slot, args=(self.args.first + i,), daemon=True)
            t.start()
            threads.append(t)
            time.sleep(self.args.stagger_s / max(1, self.args.count))
        for t in threads:
            t.join()
        self.stop_beats.set()
        beats.join()
        if self.writer is not None:
            self.writer.queue.put(None)
            self.writer.join()
        for key, holder in self.leases.items():
            if self.redis.get(key) == holder.encode():
                self.redis.delete(key)
        events_cpu = _thread_cpu_s("dartboard-events")  # before the pool's threads end
        self.pool.close()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        writer_cpu = self.writer.cpu_s if self.writer is not None else 0.0
        return {
            "cpu_s": usage.ru_utime + usage.ru_stime - start.ru_utime - start.ru_stime,
            # The platform's own code on the step path (claims, step records, finishes,
            # heartbeats: Django and the services, on the pool and writer threads; the
            # dashboard events' publisher thread) apart from the stand-in env slots' threads.
            "platform_cpu_s": self.pool.cpu_s + writer_cpu + self.beats_cpu_s + events_cpu,
            "counts": self.counts,
            "errors": self.errors[:5],
            "timings": self.timings.rows,
            "beat_ms": self.beat_ms,
            "lost_leases": self.lost_leases,
            "step_batches": self.writer.batches if self.writer is not None else [],
        }


def _thread_cpu_s(name: str) -> float:
    """The CPU time so far of this process's live thread called `name` (0 if none)."""
    for t in threading.enumerate():
        if t.name == name and t.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=int, required=True)
    ap.add_argument("--first", type=int, required=True, help="first slot index")
    ap.add_argument("--count", type=int, required=True, help="slots in this process")
    ap.add_argument("--until", type=float, required=True, help="stop claiming at (epoch s)")
    ap.add_argument("--latency-scale", type=float, default=1.0)
    ap.add_argument("--pool", type=int, default=6, help="database connections")
    ap.add_argument("--stagger-s", type=float, default=10.0, help="spread slot starts")
    ap.add_argument(
        "--batch-steps", type=int, default=0, help="most steps a transaction (0: one each)"
    )
    ap.add_argument(
        "--switch-ms",
        type=float,
        default=5.0,
        help="the interpreter's thread switch interval (Python's default: 5 ms)",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    # Tried at 1,000 slots: 0.5 ms (so a DB thread back from PostgreSQL, holding the run's
    # claim lock, waits less for the GIL) did not shorten claims (p50 5.9 -> 5.0 s) and
    # doubled the step record's p50 on the saturated machine; the default stays Python's.
    sys.setswitchinterval(args.switch_ms / 1000)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
    import django

    django.setup()
    args.out.write_text(json.dumps(Fleet(args).run()))


if __name__ == "__main__":
    main()
