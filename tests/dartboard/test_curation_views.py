"""Human curation: pool promotion, trimming, rejection, reward overrides and demo uploads,
through the services and through the pages."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
from django.conf import settings
from django.core.files.storage import default_storage
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db.models import QuerySet

from datamanager.archive import archive_open
from datamanager.config import RunConfig
from datamanager.models import RewardOverride, Step, Task, TaskStat, Trajectory
from datamanager.services import review as curate
from datamanager.services import runs as services
from datamanager.services.demos import demos_import, demos_read
from datamanager.services.episodes import (
    task_claim,
    taskstats_ensure,
    trajectory_finish,
)
from tests.conftest import png_bytes
from tests.datamanager.factories import step_record

pytestmark = pytest.mark.django_db


@pytest.fixture
def run():
    Task.objects.create(name="click-button", env_kind="miniwob", instruction="Click OK")
    r = services.run_create(name="r", config=RunConfig.from_dict({}))
    services.run_control(run_id=r.pk, action="start")
    taskstats_ensure(run=r)
    return r


def finished(run, *, steps=4, success=True) -> Trajectory:
    claim = task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
    for i in range(steps):
        step_record(
            trajectory_id=claim.trajectory_id, index=i, screenshot_png=png_bytes(color=(i * 50, 0, 0)),
            width=160, height=210, raw_output="Action: wait()", thought=f"t{i}",
            action={"type": "click", "x": i, "y": i}, parse_error="", prompt_tokens=1,
            response_tokens=1, rollout_logprobs=[-1.0], response_token_ids=[7 + i],
            mean_entropy=0.5, policy_version=1, env_ms=1.0, model_ms=1.0,
        )  # fmt: skip
    return trajectory_finish(
        trajectory_id=claim.trajectory_id,
        status="succeeded" if success else "failed",
        reward=1.0 if success else 0.0,
    )


def media_files() -> set[str]:
    root = Path(settings.MEDIA_ROOT)
    return (
        {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
        if root.exists()
        else set()
    )


# --- services ----------------------------------------------------------------------------


def test_promote_joins_the_pool_and_updates_pool_size_of_every_run(run):
    other = services.run_create(name="other", config=RunConfig.from_dict({}))
    taskstats_ensure(run=other)
    traj = finished(run)
    curate.trajectory_promote(trajectory_id=traj.pk)
    assert Trajectory.objects.get(pk=traj.pk).in_pool
    assert list(TaskStat.objects.values_list("pool_size", flat=True)) == [1, 1]
    curate.trajectory_unpool(trajectory_id=traj.pk)
    assert list(TaskStat.objects.values_list("pool_size", flat=True)) == [0, 0]


def test_failed_or_rejected_trajectories_do_not_join_the_pool(run):
    failed = finished(run, success=False)
    with pytest.raises(curate.CurationError, match="only successful trajectories"):
        curate.trajectory_promote(trajectory_id=failed.pk)
    ok = finished(run)
    curate.trajectory_promote(trajectory_id=ok.pk)
    curate.trajectory_reject(trajectory_id=ok.pk)
    ok.refresh_from_db()
    assert ok.rejected and not ok.in_pool
    assert TaskStat.objects.get(run=run).pool_size == 0
    with pytest.raises(curate.CurationError, match="rejected"):
        curate.trajectory_promote(trajectory_id=ok.pk)


def test_trim_makes_a_curated_copy_with_screenshots(run):
    traj = finished(run, steps=5)
    copy = curate.trajectory_trim(trajectory_id=traj.pk, keep_steps=3)
    assert (copy.source, copy.curated_from_id, copy.length, copy.reward) == (
        "curated",
        traj.pk,
        3,
        1.0,
    )
    steps = list(Step.objects.filter(trajectory=copy).order_by("index"))
    originals = list(Step.objects.filter(trajectory=traj).order_by("index"))[:3]
    assert [s.thought for s in steps] == ["t0", "t1", "t2"]
    copied = ("index", "screen_width", "screen_height", "raw_output", "thought", "action",
              "parse_error", "prompt_tokens", "response_tokens", "rollout_logprobs",
              "response_token_ids", "mean_entropy", "policy_version", "env_ms", "model_ms")  # fmt: skip
    for new, old in zip(steps, originals, strict=True):
        assert [getattr(new, f) for f in copied] == [getattr(old, f) for f in copied]
        assert new.screenshot.name != old.screenshot.name
        assert (
            default_storage.open(new.screenshot.name).read()
            == default_storage.open(old.screenshot.name).read()
        )
    assert Trajectory.objects.get(pk=traj.pk).length == 5
    for bad in (0, 5, 9):
        with pytest.raises(curate.CurationError, match="keep between 1 and 4 steps"):
            curate.trajectory_trim(trajectory_id=traj.pk, keep_steps=bad)


def test_reward_override_is_audited_and_moves_status(run, researcher):
    traj = finished(run)
    curate.trajectory_promote(trajectory_id=traj.pk)
    curate.trajectory_override_reward(
        trajectory_id=traj.pk, reward=0.0, reason="clicked the wrong OK", user=researcher
    )
    traj.refresh_from_db()
    assert (traj.reward, traj.reward_source, traj.status) == (0.0, "human", "failed")
    assert (
        traj.reward_override_by == researcher
        and traj.reward_override_reason == "clicked the wrong OK"
    )
    assert not traj.in_pool and TaskStat.objects.get(run=run).pool_size == 0
    audit = RewardOverride.objects.get(trajectory=traj)
    assert (audit.old_reward, audit.new_reward, audit.user) == (1.0, 0.0, researcher)
    with pytest.raises(curate.CurationError, match="say why"):
        curate.trajectory_override_reward(trajectory_id=traj.pk, reward=1, reason=" ", user=None)
    assert RewardOverride.objects.count() == 1


# --- pages -------------------------------------------------------------------------------


def test_pages_promote_reject_trim_and_override(ada_client, grace_client, run):
    traj = finished(run)
    base = f"/trajectories/{traj.pk}"
    r = ada_client.post(f"{base}/promote/", follow=True)
    assert b"Added to the task" in r.content and b"in pool" in r.content
    # A reward override is an admin's (Ada operates); Grace administers.
    r = ada_client.post(f"{base}/reward/", {"reward": "0.5", "reason": "partly right"})
    assert r.status_code == 403
    r = grace_client.post(
        f"{base}/reward/", {"reward": "0.5", "reason": "partly right"}, follow=True
    )
    html = r.content.decode()
    assert "Reward overridden." in html and "partly right" in html and "by grace" in html
    r = ada_client.post(f"{base}/trim/", {"keep_steps": 2})
    copy = Trajectory.objects.get(curated_from=traj)
    assert r["Location"] == f"/trajectories/{copy.pk}/" and copy.length == 2
    r = ada_client.post(f"{base}/reject/", follow=True)
    assert b"Rejected" in r.content and Trajectory.objects.get(pk=traj.pk).rejected
    r = ada_client.post(f"{base}/promote/", follow=True)
    assert b"Not done: a rejected trajectory cannot join the experience pool." in r.content


@pytest.mark.parametrize(
    ("action", "data", "message"),
    [
        ("reward", {"reward": "2", "reason": "x"}, "less than or equal to 1"),
        ("reward", {"reward": "1", "reason": ""}, "This field is required."),
        ("reward", {"reward": "one", "reason": "x"}, "Enter a number."),
        ("trim", {"keep_steps": "0"}, "greater than or equal to 1"),
    ],
)
def test_curation_forms_reject_bad_input_and_write_nothing(
    grace_client, run, action, data, message
):
    ada_client = grace_client  # an admin: reward overrides are admin-only
    traj = finished(run)
    before = list(Trajectory.objects.values())
    r = ada_client.post(f"/trajectories/{traj.pk}/{action}/", data)
    assert r.status_code == 400 and message in r.content.decode()
    assert list(Trajectory.objects.values()) == before and not RewardOverride.objects.exists()


def test_unknown_curation_action_is_404(ada_client, run):
    assert ada_client.post(f"/trajectories/{finished(run).pk}/delete/").status_code == 404


# --- upload ------------------------------------------------------------------------------


def archive(manifest, files: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("manifest.json", json.dumps(manifest))
        for name, data in (files or {}).items():
            zf.writestr(name, data)
    return buf.getvalue()


GOOD = [
    {"task": "click-button", "reward": 1.0, "instruction": "Click OK", "steps": [
        {"screenshot": "s/0.png", "action": {"type": "click", "x": 20, "y": 30}, "thought": "OK is here"},
        {"screenshot": "s/1.png", "action": {"type": "finished"}, "raw_output": "Action: finished()"},
    ]},
    {"task": "click-button", "reward": 0, "steps": [
        {"screenshot": "s/0.png", "action": {"type": "type", "text": "hi"}},
    ]},
]  # fmt: skip


def upload(client, data: bytes, accept=True):
    f = SimpleUploadedFile("demos.zip", data, content_type="application/zip")
    fields = {"archive": f, "format": "dartboard", "accept": "on" if accept else ""}
    return client.post("/trajectories/upload/", fields)


def test_upload_imports_trajectories_with_screenshots(ada_client, run):
    files = {
        "s/0.png": png_bytes(color=(10, 200, 30)),
        "s/1.png": png_bytes(300, 200, color=(0, 0, 255)),
    }
    r = upload(ada_client, archive(GOOD, files))
    assert r.status_code == 302 and r["Location"] == "/trajectories/?source=precollected"
    ok, bad = Trajectory.objects.filter(source="precollected").order_by("pk")
    assert (ok.status, ok.reward, ok.in_pool, ok.length, ok.run) == (
        "succeeded",
        1.0,
        True,
        2,
        None,
    )
    assert (bad.status, bad.in_pool) == ("failed", False)
    s0, s1 = ok.steps.order_by("index")
    assert (
        s0.raw_output
        == "Thought: OK is here\nAction: click(start_box='<|box_start|>(20,30)<|box_end|>')"
    )
    assert s1.raw_output == "Action: finished()" and (s1.screen_width, s1.screen_height) == (
        300,
        200,
    )
    assert default_storage.open(s1.screenshot.name).read() == files["s/1.png"]
    assert TaskStat.objects.get(run=run).pool_size == 1


@pytest.mark.parametrize(
    ("manifest", "files", "errors"),
    [
        (GOOD, {"s/0.png": png_bytes(color=(10, 200, 30))}, ["manifest.json: [0].steps[1].screenshot: 's/1.png' is not in the archive"]),
        ([{**GOOD[0], "task": "nope"}], {"s/0.png": png_bytes(color=(10, 200, 30)), "s/1.png": png_bytes(color=(10, 200, 30))},
         ["manifest.json: [0]: no task named 'nope'"]),
        ([{**GOOD[1], "reward": 3}], {"s/0.png": png_bytes(color=(10, 200, 30))}, ["manifest.json: [0].reward: must be a number in [0, 1], got 3"]),
        ([{**GOOD[1], "steps": [{"screenshot": "s/0.png", "action": {"type": "click"}}]}], {"s/0.png": png_bytes(color=(10, 200, 30))},
         ["manifest.json: [0].steps[0].action: click needs x and y"]),
        ([{**GOOD[1]}], {"s/0.png": b"GIF89a not a png"}, ["s/0.png: is not a readable image"]),
        ({"not": "a list"}, {}, ["manifest.json: must be a non-empty list of trajectories"]),
    ],
)  # fmt: skip
def test_bad_upload_names_file_and_field_and_imports_nothing(
    ada_client, run, manifest, files, errors
):
    files_before = media_files()
    r = upload(ada_client, archive(manifest, files))
    html = r.content.decode().replace("&#x27;", "'")
    assert r.status_code == 400 and "nothing was imported" in html
    for e in errors:
        assert e in html
    assert not Trajectory.objects.filter(source="precollected").exists()
    assert media_files() == files_before


def test_upload_that_is_not_a_zip(ada_client, run):
    r = upload(ada_client, b"hello")
    assert r.status_code == 400 and "upload: not a readable .zip archive" in r.content.decode()


def test_archive_reports_every_problem_at_once(run):
    manifest = [{"task": "", "reward": -1, "steps": [{"screenshot": "x.png", "action": {}}]}]
    read = demos_read(files=archive_open(io.BytesIO(archive(manifest))), fmt="dartboard")
    assert len(read.errors) == 4
    assert "manifest.json: [0].steps[0].action: an action needs a 'type'" in read.errors


def test_failed_import_cleans_up_written_files(run, monkeypatch):
    """The database goes away as the second trajectory's steps are written: neither
    trajectory nor any screenshot file stays."""
    files_before = media_files()
    real_bulk_create, real_save = QuerySet.bulk_create, Step.save
    writes = {"n": 0}  # statements writing Step rows, one or many at a time

    def second_write_fails() -> None:
        writes["n"] += 1
        if writes["n"] == 2:
            raise RuntimeError("database went away")

    def failing_bulk_create(self, objs, *a, **kw):
        if self.model is Step:
            second_write_fails()
        return real_bulk_create(self, objs, *a, **kw)

    def failing_save(self, *a, **kw):
        second_write_fails()
        return real_save(self, *a, **kw)

    monkeypatch.setattr(QuerySet, "bulk_create", failing_bulk_create)
    monkeypatch.setattr(Step, "save", failing_save)
    with pytest.raises(RuntimeError):
        demos_import(
            files=archive_open(
                io.BytesIO(
                    archive(
                        GOOD,
                        {
                            "s/0.png": png_bytes(color=(10, 200, 30)),
                            "s/1.png": png_bytes(color=(10, 200, 30)),
                        },
                    )
                )
            ),
            fmt="dartboard",
            accept=True,
        )
    assert not Trajectory.objects.filter(source="precollected").exists()
    assert media_files() == files_before
