"""The failure-annotation queue: it serves failed (or sampled) rollouts one at a time, the
labels are stored with who and when, and they act: an environment bug leaves the rollout
out of the next batch and counts against its task and host, "reward wrong" opens the
audited override, the task board counts each task's labels, and the labels export as JSONL.
(tests/dartboard/test_browser_review.py labels with the keyboard in a real chromium.)"""

from __future__ import annotations

import json
import re

import pytest

from datamanager.models import EnvSlot, FailureLabel, Trajectory
from datamanager.services import batches, episodes
from tests.datamanager.factories import make_running_run, make_tasks, play

pytestmark = pytest.mark.django_db


def _run_with_failures():
    """Two tasks, groups of three (one success, two failures each), on host h1 and h2."""
    make_tasks(2)
    run = make_running_run({"curation": {"n_max": 3, "n_min": 3}, "trainer": {"min_groups": 1}})
    slots = [
        EnvSlot.objects.create(name=f"{h}:1:miniwob:0", host=h, backend="miniwob", run=run)
        for h in ("h1", "h2")
    ]
    ids = [
        play(run, success=s, steps=2, slot_id=slots[i % 2].pk)
        for i, s in enumerate((True, True, False, False, False, False))
    ]
    return run, ids


def _queue_head(client, run, query="") -> int | None:
    html = client.get(f"/runs/{run.pk}/labels/{query}").content.decode()
    found = re.search(r'id="label-form" class="card labelform" data-trajectory="(\d+)"', html)
    return int(found.group(1)) if found else None


def test_the_queue_serves_each_failure_once_and_labels_are_stored_with_who_and_when(ada_client):
    run, ids = _run_with_failures()
    failures = set(ids[2:])
    seen = []
    for _ in range(4):
        head = _queue_head(ada_client, run)
        assert head in failures and head not in seen
        seen.append(head)
        response = ada_client.post(
            f"/runs/{run.pk}/labels/",
            {"trajectory": head, "label": "agent_mistake", "comment": "clicked the wrong box"},
        )
        assert response.status_code == 302
    assert _queue_head(ada_client, run) is None
    page = ada_client.get(f"/runs/{run.pk}/labels/").content.decode()
    assert "Nothing left to label in this queue" in page and "4 labelled in this run" in page
    label = FailureLabel.objects.get(trajectory_id=seen[0])
    assert (label.label, label.user.username, label.comment) == (
        "agent_mistake", "ada", "clicked the wrong box",
    )  # fmt: skip
    # The sampled queue serves successes too (the rest is labelled already).
    assert _queue_head(ada_client, run, "?queue=sampled") in set(ids[:2])
    # Skipping moves on without labelling.
    first = _queue_head(ada_client, run, "?queue=sampled")
    assert _queue_head(ada_client, run, f"?queue=sampled&skip={first}") not in (first, None)


def test_an_environment_bug_is_left_out_of_the_next_batch_and_counts_against_task_and_host(
    ada_client,
):
    run, ids = _run_with_failures()
    buggy = ids[2]  # task t0, host h1
    for traj in (buggy,):
        ada_client.post(f"/runs/{run.pk}/labels/", {"trajectory": traj, "label": "env_bug"})
    assert Trajectory.objects.get(pk=buggy).rejected
    batch = batches.batch_collect(run=run, current_version=0)
    assert batch is not None
    trained = {s.trajectory_id for s in batch.samples}
    assert buggy not in trained and set(ids) - {buggy} == trained

    board = ada_client.get(f"/runs/{run.pk}/tasks/").content.decode()
    row = re.search(r'<tr data-task="miniwob/t0".*?</tr>', board, re.S).group(0)
    assert 'data-label="env_bug">1 environment bug</a>' in row
    assert "environment bug" not in re.search(
        r'<tr data-task="miniwob/t1".*?</tr>', board, re.S
    ).group(0)
    hosts = ada_client.get(f"/runs/{run.pk}/").content.decode()
    h1 = re.search(r'<div class="host [a-z]+" data-host="h1".*?</div>', hosts, re.S).group(0)
    assert "1 env-bug label</span>" in h1
    listed = ada_client.get(f"/trajectories/?run={run.pk}&label=env_bug").content.decode()
    assert re.findall(r'<tr data-trajectory="(\d+)"', listed) == [str(buggy)]


def test_reward_wrong_opens_the_audited_override(ada_client):
    run, ids = _run_with_failures()
    response = ada_client.post(
        f"/runs/{run.pk}/labels/", {"trajectory": ids[3], "label": "reward_wrong"}
    )
    assert (
        response.status_code == 302
        and response["Location"] == f"/trajectories/{ids[3]}/#reward-form"
    )
    page = ada_client.get(response["Location"]).content.decode()
    assert 'id="reward-form"' in page and "reward wrong</span>" in page


def test_bad_labels_are_refused_with_the_reason_and_change_nothing(ada_client, viewer_client):
    run, ids = _run_with_failures()
    r = ada_client.post(
        f"/runs/{run.pk}/labels/", {"trajectory": ids[2], "label": "bored"}, follow=True
    )
    assert "Not labelled: unknown label &#x27;bored&#x27;" in r.content.decode()
    running = episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
    r = ada_client.post(
        f"/runs/{run.pk}/labels/",
        {"trajectory": running.trajectory_id, "label": "fine"},
        follow=True,
    )
    assert "still running; label it once it has ended" in r.content.decode()
    r = ada_client.post(
        f"/runs/{run.pk}/labels/", {"trajectory": ids[2], "label": "fine", "comment": "x" * 2001},
        follow=True,
    )  # fmt: skip
    assert "the comment is 2001 characters; at most 2000" in r.content.decode()
    assert not FailureLabel.objects.exists()
    # A viewer reads the labels but may not label.
    assert (
        viewer_client.post(
            f"/runs/{run.pk}/labels/", {"trajectory": ids[2], "label": "env_bug"}
        ).status_code
        == 403
    )
    assert viewer_client.get(f"/runs/{run.pk}/labels/").status_code == 403
    assert not Trajectory.objects.get(pk=ids[2]).rejected


def test_labels_export_as_json_lines(ada_client, viewer_client):
    run, ids = _run_with_failures()
    for traj, label in ((ids[2], "env_bug"), (ids[3], "fine")):
        ada_client.post(
            f"/runs/{run.pk}/labels/", {"trajectory": traj, "label": label, "comment": "c"}
        )
    other = make_running_run({})
    response = viewer_client.get(f"/labels.jsonl?run={run.pk}")
    assert response["Content-Type"] == "application/x-ndjson"
    rows = [json.loads(line) for line in b"".join(response.streaming_content).decode().splitlines()]
    assert [(r["trajectory"], r["label"], r["user"], r["host"]) for r in rows] == [
        (ids[2], "env_bug", "ada", "h1"), (ids[3], "fine", "ada", "h2"),
    ]  # fmt: skip
    assert all(r["run"] == run.pk and r["task"].startswith("miniwob/") and r["at"] for r in rows)
    empty = viewer_client.get(f"/labels.jsonl?run={other.pk}")
    assert b"".join(empty.streaming_content) == b""
