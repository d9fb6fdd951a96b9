"""Roles: a viewer reads and changes nothing, an operator runs and curates, only an admin
chooses checkpoint paths and desktop slots or overrides rewards; every run control attempt
is recorded with who and when (two model runs on the shared inference workers:
tests/datamanager/test_run_workers.py)."""

from __future__ import annotations

import pytest

from datamanager.config import RunConfig
from datamanager.models import RewardOverride, Run, RunAction, TaskStat, Trajectory
from datamanager.services import runs as run_services
from tests.dartboard.run_helpers import make_run
from tests.dartboard.test_auth import _ws_connect
from tests.dartboard.test_curation_views import finished

pytestmark = pytest.mark.django_db


def form(**extra) -> dict:
    from dartboard.forms import RunForm

    data = {}
    for name, field in RunForm().fields.items():
        value = field.initial
        if isinstance(value, bool):
            if value:
                data[name] = "on"
        elif isinstance(value, list):
            data[name] = ",".join(value)
        elif value is not None:
            data[name] = str(value)
    return {**data, "name": "a run", **extra}


def test_a_viewer_reads_everything_and_changes_nothing(viewer_client) -> None:
    run = make_run()
    traj = finished(run)
    stat = TaskStat.objects.filter(run=run).first()
    key = traj.steps.get(index=0).screenshot.name
    for url in (
        "/", f"/runs/{run.pk}/", f"/runs/{run.pk}/charts.json", f"/runs/{run.pk}/slots.json",
        f"/runs/{run.pk}/tasks/", "/trajectories/", f"/trajectories/{traj.pk}/",
        "/evaluations/", "/evaluations/matrix/", f"/media/{key}",
        f"/groups/{traj.group_id}/", f"/labels.jsonl?run={run.pk}",
    ):  # fmt: skip
        assert viewer_client.get(url).status_code == 200, url
    before = (Run.objects.count(), Run.objects.get(pk=run.pk).status, traj.in_pool)
    refused = [
        viewer_client.post("/runs/new/", form()),
        viewer_client.post(f"/runs/{run.pk}/control/", {"action": "stop"}),
        viewer_client.post(f"/trajectories/{traj.pk}/promote/"),
        viewer_client.post(f"/trajectories/{traj.pk}/reward/", {"reward": "0", "reason": "x"}),
        viewer_client.post(f"/runs/{run.pk}/tasks/{stat.pk}/override/", {"reason": "x"}),
        viewer_client.get("/trajectories/upload/"),
        viewer_client.get("/runs/new/"),
        viewer_client.get(f"/runs/{run.pk}/labels/"),
        viewer_client.post(f"/runs/{run.pk}/labels/", {"trajectory": traj.pk, "label": "env_bug"}),
    ]
    assert [r.status_code for r in refused] == [403] * len(refused)
    traj.refresh_from_db()
    assert (Run.objects.count(), Run.objects.get(pk=run.pk).status, traj.in_pool) == before


def test_an_operator_runs_but_only_an_admin_picks_paths_desktops_and_rewards(
    ada_client, grace_client, tiny_policy_dir
) -> None:
    r = ada_client.post("/runs/new/", form(policy=str(tiny_policy_dir)))
    assert r.status_code == 400 and "only an admin may point a run at a checkpoint path" in (
        r.content.decode()
    )
    r = ada_client.post("/runs/new/", form(**{"env.desktop_slots": "1"}))
    assert r.status_code == 400 and "only an admin may give a run desktop slots" in (
        r.content.decode()
    )
    r = ada_client.post("/runs/new/", form(**{"env.osworld_addresses": "10.0.0.5:5000"}))
    assert r.status_code == 400 and "only an admin may give a run OSWorld VMs" in (
        r.content.decode()
    )
    assert not Run.objects.exists()
    assert ada_client.post("/runs/new/", form()).status_code == 302  # the shipped policy
    r = grace_client.post(
        "/runs/new/",
        form(name="admin's", policy=str(tiny_policy_dir), **{"env.desktop_slots": "1"}),
    )
    assert r.status_code == 302
    r = grace_client.post(
        "/runs/new/",
        form(name="admin's vms", **{"env.osworld_addresses": "10.0.0.5:5000, 10.0.0.6:5000"}),
    )
    assert r.status_code == 302
    vms = Run.objects.get(name="admin's vms").config["env"]["osworld_addresses"]
    assert vms == ["10.0.0.5:5000", "10.0.0.6:5000"]
    run = make_run()
    traj = finished(run)
    assert (
        ada_client.post(
            f"/trajectories/{traj.pk}/reward/", {"reward": "0", "reason": "x"}
        ).status_code
        == 403
    )
    assert not RewardOverride.objects.exists()
    grace_client.post(f"/trajectories/{traj.pk}/reward/", {"reward": "0", "reason": "wrong"})
    override = RewardOverride.objects.get()
    assert override.user.username == "grace" and override.created_at is not None


def test_every_run_control_attempt_is_recorded_with_who_and_when(ada_client) -> None:
    run = run_services.run_create(name="audited", config=RunConfig.from_dict(make_run().config))
    Run.objects.exclude(pk=run.pk).update(status="stopped")
    ada_client.post(f"/runs/{run.pk}/control/", {"action": "start"})
    ada_client.post(f"/runs/{run.pk}/control/", {"action": "resume"})  # not paused: refused
    ada_client.post(f"/runs/{run.pk}/control/", {"action": "stop"})
    rows = list(RunAction.objects.filter(run=run).order_by("created_at", "pk"))
    assert [(a.action, a.outcome, a.user.username) for a in rows] == [
        ("start", "running", "ada"),
        ("resume", "refused: cannot resume a run that is running", "ada"),
        ("stop", "stopped", "ada"),
    ]
    assert all(a.created_at is not None for a in rows)


@pytest.mark.django_db(transaction=True)
def test_the_live_feed_needs_the_viewer_role(client, django_user_model) -> None:
    from tests.conftest import user_in_role

    nobody = django_user_model.objects.create_user("mallory", password="mallory-pass-1")
    origin = [(b"origin", b"http://127.0.0.1")]
    client.force_login(nobody)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    connected, code = _ws_connect([*origin, (b"cookie", cookie)])
    assert not connected and code == 4403
    client.force_login(user_in_role(django_user_model, "victor", "viewer"))
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    connected, _ = _ws_connect([*origin, (b"cookie", cookie)])
    assert connected
    assert Trajectory.objects.count() == 0


def test_grant_role_moves_a_user_between_roles(django_user_model) -> None:
    from django.core.management import call_command

    call_command("grant_role", "lin", "viewer", "--create")
    user = django_user_model.objects.get(username="lin")
    assert user.has_perm("datamanager.view_run") and not user.has_perm("datamanager.curate")
    call_command("grant_role", "lin", "operator")
    user = django_user_model.objects.get(username="lin")  # permissions are cached per object
    assert user.has_perm("datamanager.curate") and not user.has_perm("datamanager.administer")
    assert [g.name for g in user.groups.all()] == ["operator"]
