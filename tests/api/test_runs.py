"""Runs through the API on a live server: create from YAML or JSON with overrides, read,
start, pause, resume, stop, copy; bad input refused with the documented error and nothing
changed; another user's run and the roles; every control recorded as the dashboard's is."""

from __future__ import annotations

import json

import pytest
import yaml

from datamanager.models import Host, PlacementState, Run, RunAction, RunPlacement, RunStatus, Task
from tests.api.conftest import problem_of

ORACLE = {"policy": "oracle", "env": {"miniwob_slots": 1}, "trainer": {"lr": 2e-5}}


@pytest.fixture(autouse=True)
def tasks(transactional_db):
    for name in ("click-button", "enter-text"):
        Task.objects.get_or_create(name=name, defaults={"env_kind": "miniwob", "instruction": name})


def test_an_operator_creates_a_run_from_yaml_with_overrides_and_controls_it(api):
    ada = api("ada")
    body = yaml.safe_dump({"name": "from yaml", "config": ORACLE, "overrides": {"seed": 7}})
    made = ada.post("runs/", content=body, headers={"Content-Type": "application/yaml"})
    assert made.status_code == 201, made.text
    run = made.json()
    assert (run["name"], run["status"], run["owner"]) == ("from yaml", "created", "ada")
    assert run["config"]["seed"] == 7 and run["config"]["trainer"]["lr"] == 2e-5
    assert run["config"]["curation"]["n_max"] == 8  # resolved: every default filled in
    assert run["url"] == f"/runs/{run['id']}/"
    assert ada.get(f"runs/{run['id']}/").json() == run

    statuses = [ada.post(f"runs/{run['id']}/{a}/").json()["status"]
                for a in ("start", "pause", "resume", "stop")]  # fmt: skip
    assert statuses == ["running", "paused", "running", "stopped"]
    audit = RunAction.objects.filter(run_id=run["id"]).order_by("created_at", "pk")
    assert [(a.action, a.outcome, a.user.username) for a in audit] == [
        ("start", "running", "ada"), ("pause", "paused", "ada"),
        ("resume", "running", "ada"), ("stop", "stopped", "ada"),
    ]  # fmt: skip
    listed = ada.get("runs/", params={"status": "stopped"}).json()
    assert listed["count"] == 1 and listed["results"][0]["id"] == run["id"]


def test_a_refused_transition_is_a_conflict_recorded_with_its_reason(api):
    ada = api("ada")
    run = ada.post("runs/", json={"name": "r", "config": ORACLE}).json()
    refused = ada.post(f"runs/{run['id']}/resume/")
    assert problem_of(refused) == (409, "conflict", None)
    assert refused.json()["message"] == "cannot resume a run that is created"
    assert Run.objects.get(pk=run["id"]).status == RunStatus.CREATED
    action = RunAction.objects.get(run_id=run["id"])
    assert action.outcome == "refused: cannot resume a run that is created"


def test_every_problem_of_a_config_comes_back_at_once_in_the_run_forms_words(api, client):
    ada = api("ada")
    bad = {"trainer": {"lr": "fast", "bogus": 1}, "env": {"miniwob_slots": 100},
           "rollout": {"backend": "tgi"}}  # fmt: skip
    refused = ada.post("runs/", json={"name": "bad", "config": bad})
    assert problem_of(refused)[:2] == (400, "invalid_config")
    found = {e["field"]: e["message"] for e in refused.json()["errors"]}
    assert set(found) == {"trainer.bogus", "trainer.lr", "env.miniwob_slots", "rollout.backend"}
    assert found["trainer.lr"] == "trainer.lr: must be a number, got 'fast'"
    assert found["env.miniwob_slots"] == "env.miniwob_slots: must be between 0 and 64"
    assert not Run.objects.exists()
    # The run form says the same at the same field.
    from django.contrib.auth.models import User

    from tests.security.test_roles import form

    client.force_login(User.objects.get(username="ada"))
    page = client.post("/runs/new/", form(**{"env.miniwob_slots": "100"}))
    assert page.status_code == 400
    assert "must be between 0 and 64" in page.context["form"].errors["env.miniwob_slots"][0]
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"config": ORACLE}, "name"),
        ({"name": "", "config": ORACLE}, "name"),
        ({"name": "x" * 201, "config": ORACLE}, "name"),
        ({"name": "r", "config": ["not", "settings"]}, ""),
        ({"name": "r", "config": ORACLE, "start": "maybe"}, "start"),
        ({"name": "r", "config": ORACLE, "overrides": {"trainer.lr": -1}}, "trainer.lr"),
        ({"name": "r", "config": {"tasks": {"names": ["no-such-task"]}}}, "tasks.names"),
    ],
)
def test_bad_input_is_refused_with_its_field_and_nothing_is_made(api, body, field):
    refused = api("ada").post("runs/", json=body)
    status, code, at = problem_of(refused)
    assert status == 400 and code in ("invalid", "invalid_config")
    assert (at or "") == field
    assert not Run.objects.exists()


def test_malformed_and_oversized_bodies_are_refused_as_json(api):
    ada = api("ada")
    broken = ada.post("runs/", content=b"{not json", headers={"Content-Type": "application/json"})
    assert problem_of(broken)[:2] == (400, "parse_error")
    yaml_broken = ada.post("runs/", content=b"a: [", headers={"Content-Type": "application/yaml"})
    assert problem_of(yaml_broken)[:2] == (400, "parse_error")
    text = ada.post("runs/", content=b"name=x", headers={"Content-Type": "text/plain"})
    assert problem_of(text)[:2] == (415, "unsupported_media_type")
    huge = {"name": "big", "config": {"tasks": {"names": ["click-button"] * 200_000}}}
    too_large = ada.post("runs/", content=json.dumps(huge).encode())
    assert problem_of(too_large)[:2] == (413, "too_large")
    assert not Run.objects.exists()


def test_another_users_run_is_theirs_to_control_and_an_admins(api):
    ada, bob, grace = api("ada"), api("bob"), api("grace", "admin")
    run = ada.post("runs/", json={"name": "ada's", "config": ORACLE, "start": True}).json()
    assert run["status"] == "running"
    refused = bob.post(f"runs/{run['id']}/stop/")
    assert problem_of(refused) == (403, "not_your_run", None)
    assert "belongs to ada" in refused.json()["message"]
    assert Run.objects.get(pk=run["id"]).status == RunStatus.RUNNING
    copy = bob.post(f"runs/{run['id']}/copy/", json={"overrides": {"seed": 3}}).json()
    assert (copy["owner"], copy["name"], copy["config"]["seed"]) == ("bob", "ada's (copy)", 3)
    assert grace.post(f"runs/{run['id']}/stop/").json()["status"] == "stopped"
    outcomes = [
        (a.user.username, a.outcome)
        for a in RunAction.objects.filter(run_id=run["id"]).order_by("pk")
    ]
    assert outcomes[1][0] == "bob" and outcomes[1][1].startswith("refused: run #")
    assert outcomes[2] == ("grace", "stopped")


def test_a_viewer_reads_and_changes_nothing_and_only_an_admin_picks_a_path(api):
    ada, victor = api("ada"), api("victor", "viewer")
    run = ada.post("runs/", json={"name": "r", "config": ORACLE}).json()
    assert victor.get(f"runs/{run['id']}/").status_code == 200
    assert victor.get(f"runs/{run['id']}/slots/").json() == []
    for refused in (
        victor.post("runs/", json={"name": "v", "config": ORACLE}),
        victor.post(f"runs/{run['id']}/start/"),
        victor.post(f"runs/{run['id']}/copy/", json={}),
    ):
        assert problem_of(refused)[:2] == (403, "permission_denied")
    assert Run.objects.count() == 1 and Run.objects.get().status == RunStatus.CREATED
    path = ada.post("runs/", json={"name": "p", "config": {"policy": "/tmp/weights"}})
    assert problem_of(path) == (400, "invalid_config", "policy")
    assert "only an admin may point a run at a checkpoint path" in path.json()["message"]


def test_a_queued_run_says_why_it_waits(api):
    ada = api("ada")
    run = ada.post("runs/", json={"name": "q", "config": ORACLE}).json()
    Run.objects.filter(pk=run["id"]).update(status=RunStatus.QUEUED)
    host = Host.objects.create(name="gpu-host-1", last_seen="2026-01-01T00:00:00Z")
    RunPlacement.objects.create(
        run_id=run["id"], host=host, state=PlacementState.QUEUED, queued_at="2026-01-01T00:00:00Z",
        reason="queued: needs 4 GPUs with 40 GiB free; 2 are free on gpu-host-1",
    )  # fmt: skip
    read = ada.get(f"runs/{run['id']}/").json()
    assert read["queue_reason"] == "queued: needs 4 GPUs with 40 GiB free; 2 are free on gpu-host-1"
    assert read["placement"]["host"] == "gpu-host-1" and read["placement"]["state"] == "queued"
    assert ada.get("hosts/").json()[0]["name"] == "gpu-host-1"


def test_unknown_paths_methods_and_parameters_are_json_errors(api):
    ada = api("ada")
    assert problem_of(ada.get("nothing-here/"))[:2] == (404, "not_found")
    assert problem_of(ada.get("runs/99999/"))[:2] == (404, "not_found")
    assert problem_of(ada.delete("runs/"))[:2] == (405, "method_not_allowed")
    assert problem_of(ada.get("runs/", params={"statu": "failed"})) == (400, "invalid", "statu")
    assert problem_of(ada.get("runs/", params={"limit": 0})) == (400, "invalid", "limit")
    assert problem_of(ada.get("/api/v2/runs/"))[:2] == (404, "not_found")


def test_sessions_need_csrf_for_writes(api_url, api, django_user_model):
    import httpx
    from django.contrib.auth.hashers import PBKDF2PasswordHasher

    api("ada")  # makes the user
    # The server runs the project's settings (PBKDF2), the suite MD5: store a PBKDF2 hash.
    hashed = PBKDF2PasswordHasher().encode("lovelace-pass-1", "saltsalt", iterations=1000)
    django_user_model.objects.filter(username="ada").update(password=hashed)
    with httpx.Client(base_url=api_url, follow_redirects=False) as browser:
        browser.get("/accounts/login/")
        token = browser.cookies["csrftoken"]
        logged = browser.post(
            "/accounts/login/",
            data={"username": "ada", "password": "lovelace-pass-1", "csrfmiddlewaretoken": token},
        )
        assert logged.status_code == 302
        assert browser.get("/api/v1/me/").json()["username"] == "ada"
        body = {"name": "from the page", "config": ORACLE}
        refused = browser.post("/api/v1/runs/", json=body)
        assert problem_of(refused)[:2] == (403, "permission_denied")
        assert "CSRF" in refused.json()["message"]
        made = browser.post(
            "/api/v1/runs/", json=body, headers={"X-CSRFToken": browser.cookies["csrftoken"]}
        )
        assert made.status_code == 201
    assert Run.objects.count() == 1
