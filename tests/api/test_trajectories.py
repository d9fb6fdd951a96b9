"""Trajectories through the API on a live server: the list page's filters, a trajectory with
its steps and screenshots behind the same token, and curation recorded as the page's is."""

from __future__ import annotations

import pytest

from datamanager.models import FailureLabel, RewardOverride, Trajectory
from tests.api.conftest import problem_of
from tests.dartboard.run_helpers import make_run
from tests.dartboard.test_curation_views import finished


@pytest.fixture
def run_with_episodes(transactional_db):
    run = make_run(policy="oracle")
    won = [finished(run, success=True) for _ in range(2)]
    lost = [finished(run, steps=3, success=False) for _ in range(3)]
    return run, won, lost


def test_the_list_filters_as_the_list_page_does(api, run_with_episodes):
    run, won, lost = run_with_episodes
    victor = api("victor", "viewer")
    page = victor.get("trajectories/", params={"run": run.pk, "status": "failed", "limit": 2})
    assert page.status_code == 200, page.text
    body = page.json()
    assert body["count"] == 3 and len(body["results"]) == 2
    assert {t["id"] for t in body["results"]} <= {t.pk for t in lost}
    assert all(t["status"] == "failed" and t["task"] and t["length"] == 3 for t in body["results"])
    rest = victor.get("trajectories/", params={"run": run.pk, "status": "failed", "offset": 2})
    assert len(rest.json()["results"]) == 1
    positive = victor.get("trajectories/", params={"run": run.pk, "reward": "positive"}).json()
    assert {t["id"] for t in positive["results"]} == {t.pk for t in won}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"status": "sideways"}, "status"),
        ({"run": "twelve"}, "run"),
        ({"reward_min": "1", "reward_max": "0"}, "reward_max"),
        ({"limit": 501}, "limit"),
        ({"statuss": "failed"}, "statuss"),
    ],
)
def test_a_bad_filter_is_refused_with_its_field(api, run_with_episodes, params, field):
    refused = api("victor", "viewer").get("trajectories/", params=params)
    assert problem_of(refused) == (400, "invalid", field)


def test_a_trajectory_reads_with_its_steps_and_screenshots_need_the_token(
    api, api_url, run_with_episodes
):
    _, won, _ = run_with_episodes
    victor = api("victor", "viewer")
    detail = victor.get(f"trajectories/{won[0].pk}/").json()
    assert [s["index"] for s in detail["steps"]] == [0, 1, 2, 3]
    step = detail["steps"][1]
    assert step["thought"] == "t1" and step["action"] == {"type": "click", "x": 1, "y": 1}
    url = step["screenshot_url"]
    assert url.startswith("/api/v1/screenshots/screenshots/")
    png = victor.get(f"{api_url}{url}")
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content.startswith(b"\x89PNG")
    assert problem_of(api(None).get(f"{api_url}{url}"))[:2] == (401, "not_authenticated")
    assert problem_of(victor.get(f"{api_url}{url}".replace(".png", "x.png")))[:2] == (
        404,
        "not_found",
    )
    assert problem_of(victor.get(f"trajectories/{won[0].pk + 1000}/"))[:2] == (404, "not_found")


def test_curation_is_recorded_as_the_pages_and_refused_with_the_services_reason(
    api, run_with_episodes
):
    _, won, lost = run_with_episodes
    ada, grace, victor = api("ada"), api("grace", "admin"), api("victor", "viewer")
    accepted = ada.post(f"trajectories/{won[0].pk}/accept/")
    assert accepted.status_code == 200 and accepted.json()["in_pool"] is True
    traj = Trajectory.objects.get(pk=won[0].pk)
    assert traj.in_pool and traj.reviewed_by.username == "ada"
    refused = ada.post(f"trajectories/{lost[0].pk}/accept/")
    assert problem_of(refused) == (409, "conflict", None)
    assert "only successful trajectories join the pool" in refused.json()["message"]
    assert ada.post(f"trajectories/{lost[0].pk}/reject/").json()["rejected"] is True
    label = ada.post(
        f"trajectories/{lost[1].pk}/label/", json={"label": "agent_mistake", "comment": "missed it"}
    )
    assert label.status_code == 200 and label.json()["label"]["user"] == "ada"
    assert FailureLabel.objects.get(trajectory_id=lost[1].pk).comment == "missed it"
    assert problem_of(ada.post(f"trajectories/{lost[1].pk}/label/", json={"label": "meh"}))[:3] == (
        400,
        "invalid",
        "label",
    )
    trimmed = ada.post(f"trajectories/{won[1].pk}/trim/", json={"keep_steps": 2})
    assert trimmed.status_code == 201 and len(trimmed.json()["steps"]) == 2
    assert trimmed.json()["curated_from"] == won[1].pk
    # A reward override is an admin's, with the reason, audited.
    assert problem_of(
        ada.post(f"trajectories/{lost[2].pk}/reward/", json={"reward": 1, "reason": "x"})
    )[:2] == (403, "permission_denied")
    assert problem_of(
        grace.post(f"trajectories/{lost[2].pk}/reward/", json={"reward": 2, "reason": "x"})
    ) == (400, "invalid", "reward")
    assert (
        problem_of(grace.post(f"trajectories/{lost[2].pk}/reward/", json={"reward": 1}))[2]
        == "reason"
    )
    assert not RewardOverride.objects.exists()
    done = grace.post(
        f"trajectories/{lost[2].pk}/reward/",
        json={"reward": 1, "reason": "the checker missed the click"},
    )
    assert done.json()["reward"] == 1.0 and done.json()["reward_overrides"][0]["user"] == "grace"
    override = RewardOverride.objects.get()
    assert (override.user.username, override.reason) == ("grace", "the checker missed the click")
    assert problem_of(victor.post(f"trajectories/{won[1].pk}/reject/"))[:2] == (
        403,
        "permission_denied",
    )
    assert Trajectory.objects.get(pk=won[1].pk).rejected is False
