"""Row locks of the episode services on PostgreSQL: a claim holding the run row must not
block a finish (which inserts rows that point at the run). With FOR UPDATE it did, and 100
slots deadlocked (bench/scale.py). Skipped on SQLite (no row locks)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from datamanager import curation
from datamanager.models import GroupStatus, TaskGroup
from datamanager.services.episodes import task_claim, trajectory_finish
from tests.datamanager.factories import make_running_run, make_tasks

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_finish_completes_while_a_claim_holds_the_run(monkeypatch) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's (TEST_DATABASE_URL)")
    make_tasks(1)
    run = make_running_run({"curation": {"n_max": 1, "n_min": 1}})
    claim = task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
    assert claim is not None
    inside, release = threading.Event(), threading.Event()
    pick = curation.pick_task

    def held(candidates):  # the second claim stops here, the run row locked
        inside.set()
        release.wait(20)
        return pick(candidates)

    monkeypatch.setattr(curation, "pick_task", held)
    other = threading.Thread(
        target=lambda: (
            task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)),
            connection.close(),
        )
    )
    other.start()
    try:
        assert inside.wait(10)
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = '3s'")  # a wait on the run row fails the test
        # The group of one is complete: its finish writes the task's history row (a
        # foreign key to the run) while the other claim holds the run.
        trajectory_finish(trajectory_id=claim.trajectory_id, status="succeeded", reward=1.0)
        assert TaskGroup.objects.get(run=run, index=1).status == GroupStatus.READY
    finally:
        release.set()
        other.join(20)
        with connection.cursor() as cur:
            cur.execute("SET lock_timeout = 0")


def _pg_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's (TEST_DATABASE_URL)")


def test_a_claim_does_not_wait_for_the_run_row() -> None:
    """Claims lock only the task row they take: while another transaction holds the run
    row (a claim opening the next round of groups), a claim of a task with budget left goes
    through. Before, every claim locked the run row, and 1,000 slots queued on it."""
    from django.db import connections

    _pg_only()
    make_tasks(2)
    run = make_running_run({"curation": {"n_max": 4, "n_min": 4}})
    assert task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)) is not None
    holder = connections.create_connection("default")
    try:
        with holder.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("SELECT id FROM datamanager_run WHERE id = %s FOR NO KEY UPDATE", [run.pk])
            with connection.cursor() as mine:
                mine.execute("SET lock_timeout = '2s'")  # a wait on the run row fails the test
            assert task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)) is not None
            cur.execute("ROLLBACK")
    finally:
        holder.close()
        with connection.cursor() as mine:
            mine.execute("SET lock_timeout = 0")


def test_racing_claimers_never_over_claim_a_group_or_open_a_round_twice() -> None:
    """8 threads take 48 claims of 3 tasks with 4 rollouts a group: exactly 4 rounds of
    groups, each group claimed exactly 4 times, every claim a trajectory in its group."""
    from datamanager.models import Trajectory

    _pg_only()
    make_tasks(3)
    run = make_running_run({"curation": {"n_max": 4, "dynamic_budget": False}})
    claims: list = []
    errors: list[str] = []

    def claimer() -> None:
        try:
            taken = 0
            while taken < 6:
                claim = task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
                if claim is not None:
                    claims.append(claim)
                    taken += 1
        except Exception as exc:  # the test's finding
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            connection.close()

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(claims) == 48
    groups = TaskGroup.objects.filter(run=run)
    assert groups.count() == 12  # 4 rounds of 3 tasks: no round opened twice
    for group in groups:
        members = Trajectory.objects.filter(group=group).count()
        assert (group.claimed, members, group.budget) == (4, 4, 4), group.pk


def test_a_claim_that_finds_its_task_just_taken_holds_no_task_row_while_it_waits() -> None:
    """PostgreSQL keeps the lock of a row that a locking statement locked and then left out
    on its recheck: a claim's SKIP LOCKED statement that meets a task whose last claim was
    taken while the statement ran returns nothing but holds that task's row. The claim then
    waited for the run row, held by the claim opening the next round, which waited for that
    task row: at 3,000 slots, 32 deadlocks in 10 minutes (bench/scale.py). Here the other
    claim commits during the statement (made slow by a pg_sleep in its FROM), a transaction
    holds the run row and then writes the task row, as the round's opener does."""
    from django.db import connections

    from datamanager.models import TaskStat

    _pg_only()
    make_tasks(1)
    run = make_running_run({"curation": {"n_max": 2, "n_min": 2, "dynamic_budget": False}})
    assert task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)) is not None
    stat = TaskStat.objects.get(run=run)
    assert stat.outstanding == 1
    started, outcome = threading.Event(), {}

    def slow_lock(execute, sql, params, many, context):
        if "SKIP LOCKED" in sql and not started.is_set():
            table = 'FROM "datamanager_taskstat"'
            sql = sql.replace(table, f"{table} CROSS JOIN (SELECT pg_sleep(1)) AS slow", 1)
            started.set()
        return execute(sql, params, many, context)

    def claimer() -> None:
        try:
            with connection.execute_wrapper(slow_lock):
                outcome["claim"] = task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
        except Exception as exc:  # the test's finding: the deadlock
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            connection.close()

    other, opener = (
        connections.create_connection("default"),
        connections.create_connection("default"),
    )
    thread = threading.Thread(target=claimer)
    thread.start()
    try:
        assert started.wait(10)
        time.sleep(0.2)  # inside the claim's statement, after its snapshot
        with other.cursor() as cur:  # another claim takes the task's last claim, and commits
            cur.execute("UPDATE datamanager_taskstat SET outstanding = 0 WHERE id = %s", [stat.pk])
        with opener.cursor() as cur:
            cur.execute("BEGIN")
            cur.execute("SELECT id FROM datamanager_run WHERE id = %s FOR NO KEY UPDATE", [run.pk])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not _waits_for_a_lock(cur):
                time.sleep(0.05)  # until the claim waits for the run row
            cur.execute("SET lock_timeout = '5s'")
            # As the round's opener does, it writes the task row, which the claim must not
            # hold (one claim back, so the claim can then take it).
            cur.execute("UPDATE datamanager_taskstat SET outstanding = 1 WHERE id = %s", [stat.pk])
            cur.execute("COMMIT")
        thread.join(20)
        assert "error" not in outcome, outcome["error"]
        assert outcome["claim"] is not None  # the claim then takes one of the new round's
    finally:
        thread.join(20)
        other.close()
        opener.close()


def _waits_for_a_lock(cur) -> bool:
    cur.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
        ["%datamanager_run%FOR NO KEY UPDATE%"],
    )
    return cur.fetchone()[0] > 0
