"""The whole `make run` stack SIGKILLed at random moments, started again, and checked.

    .venv/bin/python bench/chaos.py --rounds 3 [--db sqlite|postgres] [--wait 5 60] [--seed 0]

Starts `manage.py run_dartboard` (`make run`'s launcher, with its host agent) on a temporary
DARTBOARD_HOME with the crash test's tiny run (tests/whole_stack.py: three MiniWoB++ tasks on
two chromium slots, the shipped tiny policy, groups of two, every version evaluated on three
held-out episodes). Each round lets the run go on for a random --wait (seconds, after it
collects), SIGKILLs the launcher and every process it started at once (web, Celery workers,
beat, the embedded Redis, the run's env workers with chromium, trainer, inference worker and
router), starts the launcher again on the same home, and waits until the run collects again
and every episode and evaluation the kill cut has ended. It prints one markdown table: what
was under way when killed (update, evaluation, or only collecting), seconds from the
launcher's start to a new training episode's first step, the episodes the kill cut (all
must end `aborted`), and each check of `tests/whole_stack.py::recovery_problems`: nothing
from before left running, policy versions, updates and steps without gaps, every
screenshot a step names on disk, the cut evaluation finished, no group stuck open. A
failed check's problems are printed under the table.

The workers run with `make run`'s leases, watchdog and heartbeats; --fast gives them the
tests' (tests/live_stack.py FAST_LIVENESS: 6 s leases, a watchdog pass every 2 s).
--db sqlite: the launcher's own file under the home; --db postgres: a fresh database on
127.0.0.1:5432 (user postgres), dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POSTGRES = "postgres://postgres@127.0.0.1:5432"


def _postgres_database(name: str, *, drop: bool = False) -> str:
    """A fresh, empty database `name` (or, with `drop`, none left); returns its URL."""
    with psycopg.connect(f"{POSTGRES}/postgres", autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        if not drop:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return f"{POSTGRES}/{name}"


def _django_setup(home: Path, database_url: str | None) -> None:
    """This process on the stack's database (set before Django reads its settings)."""
    os.environ.update({"DJANGO_SETTINGS_MODULE": "dartboard.settings",
                       "DARTBOARD_HOME": str(home), "DARTBOARD_PROCESSES": "per-run"})  # fmt: skip
    for var in ("DATABASE_URL", "REDIS_URL"):
        os.environ.pop(var, None)
    if database_url:
        os.environ["DATABASE_URL"] = database_url
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _cell(check: str, problems: dict[str, list[str]]) -> str:
    return f"FAIL ({len(problems[check])})" if check in problems else "ok"


def chaos(*, rounds: int, home: Path, fast: bool, wait: tuple[float, float], seed: int) -> int:
    """The rounds; returns how many had a failed check (or did not come back)."""
    # Imported here: Django must be set up on the stack's database first (`_django_setup`).
    from tests.live_stack import FAST_LIVENESS
    from tests.whole_stack import (
        CHECKS,
        CrashStack,
        aborted_by,
        collecting_since,
        crash_run_create,
        recovery_problems,
    )

    rng = random.Random(seed)
    stack = CrashStack(home=home, env={**os.environ, **(FAST_LIVENESS if fast else {})})
    run = crash_run_create(name="chaos")
    failed = 0
    notes: list[str] = []
    print(f"| round | killed during | back in | cut / aborted | {' | '.join(CHECKS.values())} |")
    print(f"|---:|---|---:|---:|{'---|' * len(CHECKS)}", flush=True)
    try:
        started = stack.start()
        stack.wait(lambda: collecting_since(run.pk, started), timeout=600, what="collecting")
        for number in range(1, rounds + 1):
            time.sleep(rng.uniform(*wait))
            cut = stack.crash(run.pk)
            try:
                restarted, back_s = stack.come_back(cut, timeout=600)
            except AssertionError as exc:
                print(f"| {number} | {cut.moment} | did not come back | | |", flush=True)
                notes.append(f"round {number}: {str(exc).splitlines()[0]}")
                failed += 1
                break
            problems = recovery_problems(cut, media_root=home / "media", restarted=restarted)
            cells = [_cell(check, problems) for check in CHECKS]
            if not cut.eval_jobs:
                cells[list(CHECKS).index("evaluation")] = "n/a"
            print(f"| {number} | {cut.moment} | {back_s:.1f} s | {len(cut.running)} / "
                  f"{aborted_by(cut)} | {' | '.join(cells)} |", flush=True)  # fmt: skip
            for check, found in problems.items():
                notes += [f"round {number}, {CHECKS[check]}: {p}" for p in found]
            failed += bool(problems)
    finally:
        stack.stop()
    for note in notes:
        print(f"- {note}")
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--wait", type=float, nargs=2, default=(5.0, 60.0), metavar=("MIN", "MAX"),
                    help="seconds the run goes on before each kill, drawn uniformly")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fast", action="store_true", help="the tests' leases and watchdog")
    ap.add_argument("--keep", action="store_true", help="keep the home (logs) at the end")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dartboard-chaos-"))
    database = f"dartboard_chaos_{os.getpid()}" if args.db == "postgres" else None
    _django_setup(home, _postgres_database(database) if database else None)
    try:
        failed = chaos(rounds=args.rounds, home=home, fast=args.fast, wait=tuple(args.wait),
                       seed=args.seed)  # fmt: skip
    finally:
        from django.db import connections  # set up by now

        connections.close_all()
        if database:
            _postgres_database(database, drop=True)
        if args.keep:
            print(f"home (logs, database): {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
