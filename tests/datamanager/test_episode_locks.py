"""Row locks of the episode services on PostgreSQL: a claim holding the run row must not
block a finish (which inserts rows that point at the run). With FOR UPDATE it did, and 100
slots deadlocked (bench/scale.py). Skipped on SQLite (no row locks)."""

from __future__ import annotations

import threading

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
