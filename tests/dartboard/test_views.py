"""Dashboard pages as a researcher uses them: runs, the run form, controls, the env wall,
charts, the task board, the trajectory list and inspector; and nothing without a login."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import (
    EnvSlot,
    PolicyVersion,
    Run,
    Step,
    Task,
    TaskStat,
    TaskStatHistory,
    TrainUpdate,
    Trajectory,
)
from datamanager.services import runs as services
from tests.dartboard.run_helpers import episode, make_run

pytestmark = pytest.mark.django_db


def field_errors(html: str, field: str) -> str:
    """The text of the form row of `field` (its errors are rendered inside it)."""
    m = re.search(
        rf'data-field="{re.escape(field)}".*?(?=data-field=|</fieldset>|</form>)', html, re.S
    )
    assert m, f"no form row for {field}"
    return m.group(0)


# --- permissions -------------------------------------------------------------------------

GET_PAGES = [
    "/runs/new/",
    "/runs/1/charts.json",
    "/runs/1/slots.json",
    "/runs/1/tasks/",
    "/runs/1/tasks/1/override/",
    "/trajectories/",
    "/trajectories/1/",
    "/trajectories/upload/",
]
POSTS = [
    ("/runs/new/", {"name": "x"}),
    ("/runs/{run}/control/", {"action": "stop"}),
    ("/runs/{run}/tasks/{stat}/override/", {"boost": 5, "reason": "x"}),
    ("/trajectories/{traj}/promote/", {}),
    ("/trajectories/{traj}/reject/", {}),
    ("/trajectories/{traj}/reward/", {"reward": 0, "reason": "x"}),
    ("/trajectories/{traj}/trim/", {"keep_steps": 1}),
    ("/trajectories/upload/", {}),
]


@pytest.mark.parametrize("url", GET_PAGES)
def test_anonymous_sees_nothing(client, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=")


@pytest.mark.parametrize(("url", "data"), POSTS)
def test_anonymous_changes_nothing(researcher, url, data):
    run = make_run()
    traj = episode(run, None, steps=2, success=True)
    stat = TaskStat.objects.filter(run=run).first()
    before = (
        Run.objects.count(),
        Trajectory.objects.count(),
        list(Trajectory.objects.values()),
        list(TaskStat.objects.values()),
        Run.objects.get(pk=run.pk).status,
    )
    response = Client().post(url.format(run=run.pk, traj=traj.pk, stat=stat.pk), data)
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    after = (
        Run.objects.count(),
        Trajectory.objects.count(),
        list(Trajectory.objects.values()),
        list(TaskStat.objects.values()),
        Run.objects.get(pk=run.pk).status,
    )
    assert after == before


def test_changes_need_csrf(researcher):
    run = make_run()
    client = Client(enforce_csrf_checks=True)
    client.force_login(researcher)
    assert client.post(f"/runs/{run.pk}/control/", {"action": "stop"}).status_code == 403
    assert Run.objects.get(pk=run.pk).status == "running"


# --- runs --------------------------------------------------------------------------------


def test_runs_list_shows_success_rate_trajectories_and_version(ada_client, researcher):
    run = make_run(owner=researcher)
    for ok in (True, True, False):
        episode(run, None, steps=1, success=ok)
    episode(run, None, steps=1, success=None)
    PolicyVersion.objects.create(run=run, version=3, checkpoint="ck/3")
    PolicyVersion.objects.create(run=run, version=4, checkpoint="ck/4")
    html = ada_client.get("/").content.decode()
    row = re.search(rf"<tr>\s*<td><a href=\"/runs/{run.pk}/\">.*?</tr>", html, re.S).group(0)
    assert "click-run" in row and "running" in row
    assert "67%" in row and "(2/3)" in row
    assert "<td>4</td>" in row  # trajectories
    assert "v4" in row


def test_run_page_says_what_its_versions_take_on_disk(ada_client, researcher):
    from django.utils import timezone

    run = make_run(owner=researcher)
    cfg = run.cfg.to_dict()
    cfg["trainer"].update(versions_kept=2, versions_keep_every=10, optimizer_states_kept=1)
    Run.objects.filter(pk=run.pk).update(config=cfg)
    mb = 2**20
    for v in range(1, 5):
        PolicyVersion.objects.create(run=run, version=v, checkpoint=f"ck/{v}", weights_bytes=23 * mb,
                                     state_bytes=45 * mb, pruned_at=timezone.now() if v < 3 else None)  # fmt: skip
    line = re.search(
        r'id="checkpoints">(.*?)</p>', ada_client.get(f"/runs/{run.pk}/").content.decode()
    ).group(1)
    assert line.startswith(
        "Checkpoints: 2 of 4 versions keep their weights (46.0 MB) and the newest 1"
    )
    assert "(45.0 MB); a version costs 23.0 MB of weights and 45.0 MB of state" in line
    assert "the newest 2, every 10th, the best by greedy success" in line


def test_run_form_lists_every_setting_with_default_and_help(ada_client):
    html = ada_client.get("/runs/new/").content.decode()
    cfg = RunConfig().to_dict()
    for section, values in cfg.items():
        names = [f"{section}.{k}" for k in values] if isinstance(values, dict) else [section]
        for name in names:
            assert f'data-field="{name}"' in html, name
    row = field_errors(html, "trainer.lr")
    assert "AdamW learning rate (the peak, under a schedule)." in row and "Default: 1e-05" in row
    assert 'value="0.28"' in field_errors(html, "trainer.clip_high")
    assert "checked" in field_errors(html, "curation.high_entropy")


def form_data(**overrides) -> dict:
    data = {"name": "fresh"}
    for key, value in RunConfig().to_dict().items():
        if isinstance(value, dict):
            for k, v in value.items():
                data[f"{key}.{k}"] = v
        else:
            data[key] = value
    data = {
        k: (", ".join(v) if isinstance(v, list) and k != "tasks.env_kinds" else v)
        for k, v in data.items()
    }
    data = {k: v for k, v in data.items() if v is not False}  # unchecked boxes are not sent
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


def test_run_form_creates_the_run_with_resolved_config(ada_client, researcher):
    Task.objects.create(name="click-button", env_kind="miniwob")
    data = form_data(
        **{"trainer.lr": "3e-5", "tasks.names": "click-button", "curation.high_entropy": None}
    )
    response = ada_client.post("/runs/new/", data)
    run = Run.objects.get(name="fresh")
    assert response.status_code == 302 and response["Location"] == f"/runs/{run.pk}/"
    assert run.owner == researcher and run.status == "created"
    assert run.config["trainer"]["lr"] == 3e-5
    assert run.config["tasks"]["names"] == ["click-button"]
    assert run.config["curation"]["high_entropy"] is False
    assert run.config == run.cfg.to_dict()


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ({"trainer.lr": "-1"}, "trainer.lr", "must be &gt; 0, got -1.0"),
        ({"trainer.lr": "fast"}, "trainer.lr", "Enter a number."),
        (
            {"env.miniwob_slots": "0", "env.desktop_slots": "0"},
            "env.miniwob_slots",
            "a run needs at least one slot",
        ),
        ({"curation.n_min": "9"}, "curation.n_min", "must satisfy 1 &lt;= n_min &lt;= n_max"),
        ({"tasks.names": "no-such-task"}, "tasks.names", "no task named no-such-task"),
        ({"tasks.env_kinds": []}, "tasks.env_kinds", "name at least one backend"),
        ({"trainer.loss_type": "dpo"}, "trainer.loss_type", "Select a valid choice"),
        ({"name": ""}, "name", "This field is required."),
    ],
)
def test_run_form_shows_error_at_the_field_and_writes_nothing(
    ada_client, overrides, field, message
):
    response = ada_client.post("/runs/new/", form_data(**overrides))
    assert response.status_code == 400
    row = field_errors(response.content.decode(), field)
    assert "errorlist" in row and message in row
    assert Run.objects.count() == 0


def test_copy_into_new_run_prefills_the_form(ada_client):
    run = make_run(
        trainer={"lr": 2e-4, "loss_type": "gspo"}, tasks={"names": ["click-button", "enter-text"]}
    )
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert f'href="/runs/new/?from={run.pk}"' in page
    html = ada_client.get(f"/runs/new/?from={run.pk}").content.decode()
    assert 'value="click-run (copy)"' in html
    assert 'value="0.0002"' in field_errors(html, "trainer.lr")
    assert 'value="gspo" selected' in field_errors(html, "trainer.loss_type")
    assert 'value="click-button, enter-text"' in field_errors(html, "tasks.names")


def test_run_controls_and_invalid_transition_message(ada_client):
    run = make_run()
    r = ada_client.post(f"/runs/{run.pk}/control/", {"action": "pause"}, follow=True)
    assert Run.objects.get(pk=run.pk).status == "paused" and b"is paused" in r.content
    r = ada_client.post(f"/runs/{run.pk}/control/", {"action": "pause"}, follow=True)
    assert b"Could not pause the run: cannot pause a run that is paused." in r.content
    ada_client.post(f"/runs/{run.pk}/control/", {"action": "stop"})
    assert Run.objects.get(pk=run.pk).status == "stopped"
    assert ada_client.get(f"/runs/{run.pk}/control/").status_code == 405


def test_charts_json_has_every_chart_with_data(ada_client):
    run = make_run(curation={"n_max": 2, "n_min": 1})
    slot = EnvSlot.objects.create(name="h:1:0", host="h", backend="miniwob", run=run)
    for i in range(6):
        episode(run, slot, steps=2, success=i % 2 == 0)
    # In one minute's bucket: written across a minute's turn, they would make two points.
    Trajectory.objects.filter(run=run).update(finished_at=timezone.now())
    TrainUpdate.objects.create(
        run=run,
        number=1,
        policy_version=0,
        metrics={"loss": 0.5, "kl": 0.01, "duration_s": 3.0, "staleness": {"0": 10, "1": 4},
                 "passes": "ref+grad", "encode_s": 0.4, "old_pass_s": 0.0, "ref_pass_s": 0.7,
                 "grad_pass_s": 1.8, "optimizer_s": 0.1},
    )  # fmt: skip
    figs = ada_client.get(f"/runs/{run.pk}/charts.json").json()
    assert set(figs) == {
        "success",
        "budget",
        "step_cap",
        "throughput",
        "utilisation",
        "training",
        "update_phases",
        "logprob_gap",
        "staleness",
        "groups",
        "versions",
        "errors_host",
        "errors_task",
        "left_out",
    }
    overall = figs["success"]["data"][0]
    assert overall["name"] == "overall" and overall["y"] == [0.5]
    assert {t["name"] for t in figs["success"]["data"][1:]} <= {"click-button", "enter-text"}
    assert figs["throughput"]["data"][0]["y"] == [12.0]  # 12 actions in one 1-minute bucket
    assert figs["throughput"]["data"][1]["y"] == [6.0]
    env_share = figs["utilisation"]["data"][0]["y"][0]
    assert 0 < env_share <= 1
    assert figs["utilisation"]["data"][1]["y"] == [pytest.approx(3.0 / 60)]
    assert [t["name"] for t in figs["training"]["data"]][:2] == ["loss", "kl"]
    phases = figs["update_phases"]
    assert "latest update's passes: ref+grad" in phases["layout"]["title"]["text"]
    assert {t["name"]: t["y"] for t in phases["data"]}["gradient pass"] == [1.8]
    assert figs["staleness"]["data"][0]["x"] == ["0", "1"] and figs["staleness"]["data"][0][
        "y"
    ] == [10, 4]
    assert TaskStatHistory.objects.filter(run=run).exists()
    assert figs["budget"]["data"] and figs["step_cap"]["data"]


def test_charts_of_an_empty_run_say_no_data(ada_client):
    run = make_run()
    figs = ada_client.get(f"/runs/{run.pk}/charts.json").json()
    assert figs["success"]["data"] == []
    assert figs["success"]["layout"]["annotations"][0]["text"] == "no data yet"


# --- task board --------------------------------------------------------------------------


def test_task_board_rows_and_sparkline(ada_client):
    run = make_run(curation={"n_max": 2, "n_min": 2})  # 4 episodes complete 2 groups
    for i in range(4):
        episode(run, None, steps=2, success=i != 1)
    html = ada_client.get(f"/runs/{run.pk}/tasks/").content.decode()
    stats = list(TaskStat.objects.filter(run=run).select_related("task"))
    assert stats
    for stat in stats:
        # Every task of this run has played: its history and last success exist.
        assert TaskStatHistory.objects.filter(run=run, task=stat.task).exists()
        assert stat.last_success_at is not None
        row = re.search(rf'<tr data-task="{stat.task.name}".*?</tr>', html, re.S).group(0)
        assert f"<td>{stat.step_cap}</td>" in row and f"{stat.attempts} " in row
        assert '<svg class="spark"' in row
        assert " ago" in row


def test_task_override_records_user_time_and_reason(ada_client):
    run = make_run()
    stat = TaskStat.objects.filter(run=run).first()
    url = f"/runs/{run.pk}/tasks/{stat.pk}/override/"
    r = ada_client.post(url, {"pinned_budget": 3, "boost": 2, "reason": ""})
    assert r.status_code == 400 and "This field is required." in field_errors(
        r.content.decode(), "reason"
    )
    r = ada_client.post(url, {"pinned_budget": 99, "boost": 1, "reason": "x"})
    assert "less than or equal to 64" in field_errors(r.content.decode(), "pinned_budget")
    stat.refresh_from_db()
    assert stat.pinned_budget is None and stat.override_note == ""
    r = ada_client.post(
        url, {"pinned_budget": 3, "boost": 2, "retired": "on", "reason": "too easy"}
    )
    assert r.status_code == 302
    stat.refresh_from_db()
    assert (stat.pinned_budget, stat.boost, stat.retired) == (3, 2.0, True)
    assert "ada: budget pinned to 3, boost 1 -> 2, retired — too easy" in stat.override_note
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", stat.override_note)
    board = ada_client.get(f"/runs/{run.pk}/tasks/").content.decode()
    assert "too easy" in board and "pinned" in board and "retired" in board


def test_task_override_of_another_runs_stat_is_404(ada_client):
    run, other = make_run(), make_run(name="other")
    stat = TaskStat.objects.filter(run=other).first()
    assert ada_client.get(f"/runs/{run.pk}/tasks/{stat.pk}/override/").status_code == 404


# --- trajectories ------------------------------------------------------------------------


def test_trajectory_list_filters_and_pages(ada_client):
    run = make_run()
    other = make_run(name="other")
    for i in range(55):
        episode(run, None, steps=1, success=i % 5 == 0, version=i % 2)
    episode(other, None, steps=1, success=True)
    page = ada_client.get(f"/trajectories/?run={run.pk}").content.decode()
    assert "55 trajectories" in page and "page 1 of 2" in page
    assert "older ›" in page and f"?run={run.pk}&page=2" in page
    page = ada_client.get(f"/trajectories/?run={run.pk}&status=succeeded").content.decode()
    assert "11 trajectories" in page
    page = ada_client.get(f"/trajectories/?run={run.pk}&policy_version=1").content.decode()
    assert "27 trajectories" in page
    page = ada_client.get("/trajectories/?reward=positive").content.decode()
    assert "12 trajectories" in page
    page = ada_client.get("/trajectories/?task=enter&source=online").content.decode()
    assert str(Trajectory.objects.filter(task__name="enter-text").count()) + " trajectories" in page
    bad = ada_client.get("/trajectories/?status=bogus&run=x")
    assert bad.status_code == 400 and b"Select a valid choice" in bad.content


def test_trajectory_page_shows_steps_action_overlay_and_trainer_view(ada_client):
    run = make_run()
    traj = episode(run, None, steps=4, success=True, version=5)
    Step.objects.filter(trajectory=traj, index=0).update(
        entropy_kept=False, advantage=0.75, is_weight=0.9
    )
    html = ada_client.get(f"/trajectories/{traj.pk}/").content.decode()
    sections = re.findall(r'<section class="step".*?</section>', html, re.S)
    assert len(sections) == 4
    first, second, third, fourth = sections
    assert '<circle cx="40" cy="60"' in first and 'viewBox="0 0 160 210"' in first
    assert "masked" in first and "0.750" in first and "0.900" in first
    assert "sum -1.000 · mean -0.333" in first and "env 42 ms · model 130 ms" in first
    assert "type: &#x27;hello&#x27;" in second
    assert '<line x1="10" y1="10" x2="100" y2="150"' in third
    assert 'data-action="scroll"' in fourth and "marker-end" in fourth
    assert "thinking about step 0" in first and "v5" in first
    assert "not trained yet" in second
    assert "hidden" in first and "hidden" not in fourth.split(">")[0]
    assert 'id="prompts-refused"' not in html
    refusal = (
        "http://w answered 400: the prompt takes 16400 tokens (images included); at most 16384"
    )
    traj.details = {**traj.details, "prompts_refused": [{"step": 2, "refusal": refusal}]}
    traj.save(update_fields=["details"])
    html = ada_client.get(f"/trajectories/{traj.pk}/").content.decode()
    assert "Prompts refused for length" in html and "step 2: " + refusal in html
    assert ada_client.get("/trajectories/999999/").status_code == 404


def test_start_creates_task_stats_or_says_why_it_cannot(
    ada_client, django_capture_on_commit_callbacks
):
    from datamanager.config import RunConfig
    from datamanager.models import TaskStat

    empty = services.run_create(
        name="no-tasks", config=RunConfig.from_dict({"tasks": {"names": ["nope"]}})
    )
    r = ada_client.post(f"/runs/{empty.pk}/control/", {"action": "start"}, follow=True)
    assert b"no task matches" in r.content and b"import tasks first" in r.content
    assert Run.objects.get(pk=empty.pk).status == "created"  # nothing half-started

    Task.objects.create(name="miniwob/click-test", env_kind="miniwob")
    run = services.run_create(name="oracle", config=RunConfig.from_dict({"policy": "oracle"}))
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        ada_client.post(f"/runs/{run.pk}/control/", {"action": "start"})
    assert Run.objects.get(pk=run.pk).status == "running"
    assert TaskStat.objects.filter(run=run).count() == 1
    assert len(callbacks) == 1  # the slot tasks are enqueued after commit


def test_the_budget_chart_has_a_point_per_bucket_not_per_group(ada_client):
    """A 1,000-slot run finishes a group every few seconds: one point each made the chart
    JSON 1.1 MB. A bucket shows the mean of its groups."""
    run = make_run()
    task = Task.objects.get(name="click-button")
    for budget, cap in ((8, 15), (4, 15), (3, 12)):  # three groups in the same minute
        TaskStatHistory.objects.create(
            run=run, task=task, success_rate=0.5, rollout_budget=budget, step_cap=cap
        )
    TaskStatHistory.objects.filter(run=run).update(at=run.created_at)  # one bucket, surely
    figs = ada_client.get(f"/runs/{run.pk}/charts.json").json()
    (budget,) = [t for t in figs["budget"]["data"] if t["name"] == "click-button"]
    (cap,) = [t for t in figs["step_cap"]["data"] if t["name"] == "click-button"]
    assert budget["y"] == [5.0] and cap["y"] == [14.0]
