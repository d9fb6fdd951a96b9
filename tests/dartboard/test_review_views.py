"""The review views as a researcher uses them: one GRPO group side by side, two checkpoints'
episodes of the same task and seed with the step where they part, the chart points and the
reward histogram that lead to the rollouts behind them, and the filters they use.

Episodes are recorded through the services an env worker calls (tests/datamanager/factories)."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, urlparse

import pytest
from django.utils import timezone

from datamanager.models import EnvSlot, EvalJob, Purpose, Step, TaskGroup, TrainUpdate, Trajectory
from datamanager.services import episodes
from tests.conftest import png_bytes
from tests.datamanager.factories import make_running_run, make_tasks, play, step_record

pytestmark = pytest.mark.django_db


def listed(client, url: str) -> set[int]:
    html = client.get(url).content.decode()
    return {int(x) for x in re.findall(r'<tr data-trajectory="(\d+)"', html)}


def _group_run():
    """One task, groups of three: a success and two failures, on slot h1."""
    make_tasks(1)
    run = make_running_run({"curation": {"n_max": 3, "n_min": 3}})
    slot = EnvSlot.objects.create(name="h1:1:miniwob:0", host="h1", backend="miniwob", run=run)
    ids = [play(run, success=s, steps=3, slot_id=slot.pk) for s in (True, False, False)]
    return run, ids


def test_the_group_view_shows_every_member_side_by_side_with_its_figures(ada_client):
    run, ids = _group_run()
    group = TaskGroup.objects.get(run=run)
    demo = play(run, success=True, steps=2)  # the next group's first member stands in as a demo
    TaskGroup.objects.filter(pk=group.pk).update(pool_members=[demo])

    html = ada_client.get(f"/groups/{group.pk}/").content.decode()
    lanes = re.findall(r'<div class="lane" data-trajectory="(\d+)">', html)
    assert [int(x) for x in lanes] == [*ids, demo]
    assert html.count('<a class="frame') == 3 * 3 + 2  # every step of every member, as a frame
    assert html.count("pool demo</span>") == 1
    # Not trained yet: the advantage the trainer would give (rewards 1, 0, 0, and the demo's 1).
    advantages = re.findall(r'<dd class="advantage">([-0-9.]+) <span class="muted"', html)
    assert [float(a) for a in advantages] == [0.866, -0.866, -0.866, 0.866]
    assert html.count('<dd class="end">step_cap</dd>') == 0  # play() ends without a reason
    assert html.count('<dd class="end">succeeded</dd>') == 2

    # Once an update trained it, the lane shows the trainer's figures per step.
    Step.objects.filter(trajectory_id=ids[0]).update(
        advantage=1.25, is_weight=0.75, entropy_kept=True
    )
    Step.objects.filter(trajectory_id=ids[1], index=2).update(stale=True, entropy_kept=False)
    html = ada_client.get(f"/groups/{group.pk}/").content.decode()
    assert '<dd class="advantage">1.250</dd>' in html
    assert html.count("w 0.75") == 3 and html.count(">kept<") == 3
    assert html.count(">masked<") == 1 and html.count(">stale<") == 1


def test_the_group_opens_from_the_inspector_the_list_the_task_board_and_the_chart(ada_client):
    run, ids = _group_run()
    group = TaskGroup.objects.get(run=run)
    url = f"/groups/{group.pk}/"
    assert (
        f'href="{url}" id="group-link"'
        in ada_client.get(f"/trajectories/{ids[0]}/").content.decode()
    )
    assert (
        f'href="{url}" class="group-link"'
        in ada_client.get(f"/trajectories/?run={run.pk}").content.decode()
    )
    assert (
        f'href="{url}" class="group-link"'
        in ada_client.get(f"/runs/{run.pk}/tasks/").content.decode()
    )
    groups = ada_client.get(f"/runs/{run.pk}/charts.json").json()["groups"]["data"][0]
    assert groups["customdata"] == [url] and groups["y"] == [pytest.approx(1 / 3)]
    assert ada_client.get("/groups/999999/").status_code == 404


def _eval_episode(job: EvalJob, task, seed: int, actions: list[dict], success: bool) -> int:
    traj = Trajectory.objects.create(
        task=task, purpose=Purpose.EVAL, eval_job=job, seed=seed, status="running"
    )
    for i, action in enumerate(actions):
        step_record(
            trajectory_id=traj.pk, index=i, screenshot_png=png_bytes(color=(i * 30, 90, 200)),
            width=160, height=210, raw_output="Action: ...", thought="", action=action,
            parse_error="", prompt_tokens=10, response_tokens=3, rollout_logprobs=[],
            mean_entropy=0.3, policy_version=0, env_ms=1.0, model_ms=1.0,
        )  # fmt: skip
    episodes.trajectory_finish(
        trajectory_id=traj.pk, status="succeeded" if success else "failed",
        reward=1.0 if success else 0.0, details={"end_reason": "finished"},
    )  # fmt: skip
    return traj.pk


def test_two_checkpoints_episodes_side_by_side_with_the_first_divergence_marked(ada_client):
    (task,) = make_tasks(1)
    a = EvalJob.objects.create(name="v0", policy="run:1:v0", task_names=[task.name], k=1)
    b = EvalJob.objects.create(name="v3", policy="run:1:v3", task_names=[task.name], k=1)
    click = {"type": "click", "x": 40, "y": 60}
    _eval_episode(a, task, 7, [click, click, {"type": "click", "x": 100, "y": 20}], False)
    _eval_episode(b, task, 7, [click, click, {"type": "click", "x": 80, "y": 150},
                               {"type": "finished"}], True)  # fmt: skip
    _eval_episode(a, task, 8, [click], True)  # a seed only A ran: nothing to compare

    compare = ada_client.get(f"/evaluations/compare/?a={a.pk}&b={b.pk}").content.decode()
    links = re.findall(r'href="([^"]+)" class="episode-link">(\d+)<', compare)
    assert [seed for _, seed in links] == ["7"]
    html = ada_client.get(links[0][0].replace("&amp;", "&")).content.decode()
    assert "the episodes part at <b>step 2</b>" in html
    for side in ("A", "B"):
        marked = re.search(rf'id="diverge-{side}".*?data-step="(\d+)"', html, re.S)
        assert marked and marked.group(1) == "2"
    assert "(100,20)" in html and "(80,150)" in html

    missing = ada_client.get(
        f"/evaluations/compare/episodes/?a={a.pk}&b={b.pk}&task={task.name}&seed=8"
    )
    assert (
        missing.status_code == 404
        and "Job B has no episode of miniwob/t0 with seed 8" in missing.content.decode()
    )
    assert ada_client.get("/evaluations/compare/episodes/?a=x").status_code == 400


def test_a_chart_point_opens_the_trajectories_of_its_window_or_its_update(ada_client):
    make_tasks(2)
    run = make_running_run({"curation": {"n_max": 2, "n_min": 2}})
    ids = [play(run, success=s, steps=2) for s in (True, False, True, False)]
    old = Trajectory.objects.get(pk=ids[0])
    Trajectory.objects.filter(pk=old.pk).update(
        finished_at=timezone.now() - timezone.timedelta(hours=2)
    )
    update = TrainUpdate.objects.create(run=run, number=1, policy_version=0, metrics={"loss": 0.3})
    Step.objects.filter(trajectory_id__in=ids[1:3]).update(trained_in_update=update)

    figs = ada_client.get(f"/runs/{run.pk}/charts.json").json()
    overall = figs["success"]["data"][0]
    behind = set()
    for link in overall["customdata"]:
        behind |= listed(ada_client, link)
    assert behind == set(ids)  # every finished rollout sits behind exactly one point
    last = listed(ada_client, overall["customdata"][-1])
    assert old.pk not in last and last == set(ids[1:])
    query = parse_qs(urlparse(overall["customdata"][-1]).query)
    assert query["run"] == [str(run.pk)] and "finished_from" in query and "finished_to" in query

    training = figs["training"]["data"][0]
    assert training["customdata"] == [f"/trajectories/?run={run.pk}&update=1"]
    assert listed(ada_client, training["customdata"][0]) == set(ids[1:3])
    throughput = figs["throughput"]["data"][0]["customdata"]
    assert throughput == overall["customdata"]


def test_the_reward_histogram_bins_filter_the_list(ada_client):
    make_tasks(2)
    run = make_running_run({"curation": {"n_max": 3, "n_min": 3}})
    ids = [play(run, success=s, steps=1) for s in (True, False, False, True, False, False)]
    Trajectory.objects.filter(pk=ids[0]).update(reward=0.5)
    page = ada_client.get(f"/trajectories/?run={run.pk}").content.decode()
    bins = re.findall(
        r'<a href="\?([^"]+)" class="bin[^"]*" data-bin="([^"]+)" aria-label="reward [^:]+: (\d+)',
        page,
    )
    assert [(label, int(n)) for _, label, n in bins] == [("0", 4), ("0.5", 1), ("1", 1)]
    for query, label, n in bins:
        shown = listed(ada_client, "/trajectories/?" + query.replace("&amp;", "&"))
        rewards = {Trajectory.objects.get(pk=t).reward for t in shown}
        assert len(shown) == int(n) and rewards == {float(label)}
    # A filter narrows the histogram too; a bin's link keeps the filter.
    page = ada_client.get(
        f"/trajectories/?run={run.pk}&task=miniwob/t1&task_exact=on"
    ).content.decode()
    narrowed = re.findall(
        r'<a href="\?([^"]+)" class="bin[^"]*" data-bin="[^"]+" aria-label="reward [^:]+: (\d+)',
        page,
    )
    assert sum(int(n) for _, n in narrowed) == 3 and "task=miniwob%2Ft1" in narrowed[0][0]


def test_filters_by_end_reason_env_error_entropy_is_weight_host_and_version(ada_client):
    make_tasks(1)
    run = make_running_run({"curation": {"n_max": 4, "n_min": 4}})
    h1 = EnvSlot.objects.create(name="h1:1:miniwob:0", host="h1", backend="miniwob", run=run)
    h2 = EnvSlot.objects.create(name="h2:1:miniwob:0", host="h2", backend="miniwob", run=run)
    capped = play(run, success=False, steps=2, slot_id=h1.pk)
    Trajectory.objects.filter(pk=capped).update(details={"end_reason": "step_cap"})
    said = play(run, success=True, steps=2, slot_id=h2.pk, version=3)
    Trajectory.objects.filter(pk=said).update(details={"end_reason": "finished"})
    Step.objects.filter(trajectory_id=said, index=1).update(mean_entropy=2.5, is_weight=0.2)
    claim = episodes.task_claim(run_id=run.pk, slot_id=h1.pk, env_kinds=("miniwob",))
    episodes.trajectory_finish(trajectory_id=claim.trajectory_id, status="error", reward=None,
                               error="EnvUnavailable: chromium died")  # fmt: skip
    claim2 = episodes.task_claim(run_id=run.pk, slot_id=h2.pk, env_kinds=("miniwob",))
    episodes.trajectory_finish(trajectory_id=claim2.trajectory_id, status="error", reward=None,
                               error="inference: connection refused")  # fmt: skip
    env_error, inference = claim.trajectory_id, claim2.trajectory_id
    base = f"/trajectories/?run={run.pk}"

    assert listed(ada_client, base + "&end=step_cap") == {capped}
    assert listed(ada_client, base + "&end=finished") == {said}
    assert listed(ada_client, base + "&end=error") == {env_error, inference}
    assert listed(ada_client, base + "&env_error=yes") == {env_error}  # not the policy server's
    assert listed(ada_client, base + "&env_error=no") == {capped, said, inference}
    assert listed(ada_client, base + "&entropy_min=2&entropy_max=3") == {said}
    assert listed(ada_client, base + "&is_weight_min=0&is_weight_max=0.5") == {said}
    assert listed(ada_client, base + "&host=h1") == {capped, env_error}
    assert listed(ada_client, base + "&policy_version=3") == {said}
    bad = ada_client.get(base + "&entropy_min=3&entropy_max=1")
    assert bad.status_code == 400 and "must not be below entropy_min (3.0)" in bad.content.decode()
