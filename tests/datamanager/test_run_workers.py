"""Shared mode (DARTBOARD_PROCESSES=shared, or auto with no host agent reporting): every run
without processes of its own uses the one shared rollout service, whose inference workers
serve one policy at a time. A second model run starting there would switch the first one's
weights, so `run_apply` refuses it, naming the run that holds the workers, for every way in
(the web, the API and the CLI, which prints the API's message)."""

from __future__ import annotations

import threading

import pytest
from django.contrib.messages import get_messages
from django.db import connection

from datamanager.config import RunConfig
from datamanager.models import PlacementState, Run, RunAction
from datamanager.services import run_workers
from datamanager.services import runs as run_services
from datamanager.services.placement import placement_queue, placement_set
from datamanager.services.run_workers import RunNotStartable, run_apply
from datamanager.services.tokens import api_token_create
from tests.dartboard.run_helpers import make_run
from tests.helpers import wait_until

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def shared_mode(settings):
    settings.DARTBOARD_PROCESSES = "shared"


def second_run(first: Run, name: str = "second") -> Run:
    return run_services.run_create(
        name=name, config=RunConfig.from_dict(first.config), owner=first.owner
    )


def test_a_second_model_run_is_refused_while_the_first_runs_or_is_paused_there() -> None:
    first = make_run()
    second = second_run(first)
    holds = f"run #{first.pk} 'click-run' is running on the shared inference workers"
    with pytest.raises(RunNotStartable, match=holds) as refused:
        run_apply(run_id=second.pk, action="start")
    assert "stop it first" in str(refused.value) and "DARTBOARD_PROCESSES=per-run" in str(
        refused.value
    )
    assert Run.objects.get(pk=second.pk).status == "created"  # nothing half-started
    (action,) = RunAction.objects.filter(run=second)
    assert action.outcome == f"refused: {refused.value}"
    # Paused, it still holds the workers: resuming would sync its weights back over them.
    run_apply(run_id=first.pk, action="pause")
    with pytest.raises(RunNotStartable, match=f"run #{first.pk} 'click-run' is paused"):
        run_apply(run_id=second.pk, action="start")
    run_apply(run_id=first.pk, action="stop")
    assert run_apply(run_id=second.pk, action="start").status == "running"
    # Now the second holds them: the first cannot come back beside it.
    with pytest.raises(RunNotStartable, match=f"run #{second.pk} 'second' is running"):
        run_apply(run_id=first.pk, action="start")


def test_the_scripted_oracle_runs_beside_a_model_run_and_holds_nothing() -> None:
    first = make_run()
    scripted = run_services.run_create(
        name="scripted", config=RunConfig.from_dict({"policy": "oracle"})
    )
    assert run_apply(run_id=scripted.pk, action="start").status == "running"
    run_apply(run_id=first.pk, action="stop")
    assert run_apply(run_id=second_run(first).pk, action="start").status == "running"


@pytest.mark.parametrize("state", [PlacementState.UP, PlacementState.STARTING,
                                   PlacementState.QUEUED])  # fmt: skip
def test_a_run_with_its_own_processes_does_not_hold_the_shared_workers(state) -> None:
    """A run a host agent placed (its processes up or starting, or placed again after its
    host stopped reporting) has its own router: a shared run may start beside it. One whose
    placement ended uses the shared workers again, and holds them."""
    first = make_run()
    placement = placement_queue(run_id=first.pk)
    placement_set(placement_id=placement.pk, state=state)
    second = second_run(first)
    assert run_apply(run_id=second.pk, action="start").status == "running"
    run_apply(run_id=second.pk, action="stop")
    placement_set(placement_id=placement.pk, state=PlacementState.ENDED)
    with pytest.raises(RunNotStartable, match=f"run #{first.pk} 'click-run' is running"):
        run_apply(run_id=second.pk, action="start")


def test_the_web_and_the_api_say_which_run_holds_the_workers(ada_client, researcher) -> None:
    first = make_run(owner=researcher)
    second = second_run(first)
    holds = f"run #{first.pk} 'click-run' is running on the shared inference workers"
    page = ada_client.post(f"/runs/{second.pk}/control/", {"action": "start"})
    said = [str(m) for m in get_messages(page.wsgi_request)]
    assert len(said) == 1 and said[0].startswith(f"Could not start the run: {holds}"), said
    token = api_token_create(user=researcher, name="tests").secret
    api = ada_client.post(f"/api/v1/runs/{second.pk}/start/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert api.status_code == 409, api.content
    body = api.json()
    assert body["code"] == "not_startable" and body["message"].startswith(holds), body
    assert Run.objects.get(pk=second.pk).status == "created"


@pytest.mark.django_db(transaction=True)
def test_two_model_runs_started_at_once_on_postgresql_one_runs(monkeypatch) -> None:
    """The second start waits for the first to commit, then finds it holding the workers:
    without the lock, each finds them free before the other commits and both run."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrent transactions are PostgreSQL's (TEST_DATABASE_URL)")
    first = make_run()
    run_apply(run_id=first.pk, action="stop")
    a, b = second_run(first, "a"), second_run(first, "b")
    inside, release = threading.Event(), threading.Event()
    holder = run_workers.run_holding_shared_workers
    asked: list[int] = []

    def held(*, besides: int) -> Run | None:
        """The first start stops here, having found no holder, its own run not committed."""
        found = holder(besides=besides)
        asked.append(besides)
        if len(asked) == 1:
            inside.set()
            release.wait(20)
        return found

    monkeypatch.setattr(run_workers, "run_holding_shared_workers", held)
    outcomes: dict[int, str] = {}

    def start(run: Run) -> None:
        try:
            outcomes[run.pk] = run_apply(run_id=run.pk, action="start").status
        except RunNotStartable as exc:
            outcomes[run.pk] = str(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=start, args=(run,)) for run in (a, b)]
    threads[0].start()
    try:
        assert inside.wait(20)
        threads[1].start()

        def second_waits_or_asks() -> bool:
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                               "AND NOT granted")  # fmt: skip
                return cursor.fetchone()[0] > 0 or len(asked) > 1

        wait_until(second_waits_or_asks, timeout=20, what="the second start")
    finally:
        release.set()
        for thread in threads:
            thread.join(20)
    assert outcomes[a.pk] == "running"
    assert outcomes[b.pk].startswith(f"run #{a.pk} 'a' is running on the shared"), outcomes
    assert Run.objects.get(pk=b.pk).status == "created"
