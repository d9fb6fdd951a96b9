"""Exporting trajectories for training elsewhere: a Hugging Face dataset the `datasets` library
loads, an SFT view the policy's own chat template renders, OSWorld result folders that import
back to the same steps, and the browser's background export with its download."""

from __future__ import annotations

import io
import zipfile

import pytest
from django.core.management import CommandError, call_command
from PIL import Image

from core.policy import load_policy
from datamanager.models import DatasetExport, Trajectory
from datamanager.policies import policy_path
from datamanager.services.datasets import dataset_export_run
from tests.datamanager.test_demo_import import COLORS, TASK_ID, color_of, osworld_folder
from tests.datamanager.test_demo_import import osworld_task as osworld_task

pytestmark = pytest.mark.django_db

CODE = ["pyautogui.click(100, 50)", "pyautogui.typewrite('hi there')", "DONE"]


@pytest.fixture
def imported(tmp_path, osworld_task) -> list[Trajectory]:
    """Two imported episodes of the task: one scored 1, one scored 0."""
    call_command("import_demos", osworld_folder(tmp_path / "a", CODE), "--format", "osworld")
    fail = osworld_folder(tmp_path / "b", ["pyautogui.click(5, 5)", "FAIL"], score="0\n")
    call_command("import_demos", fail, "--format", "osworld")
    return list(Trajectory.objects.order_by("pk"))


def _load(out, config, cache):
    """An export's `config` as the `datasets` library loads it (the library, slow to import, is
    imported here, by the tests that read one, not at every xdist worker's collection)."""
    import datasets

    return datasets.load_dataset(str(out), config, split="train", cache_dir=cache)


def test_hf_export_loads_with_datasets_with_images_and_a_card(tmp_path, imported):
    out = tmp_path / "export"
    call_command("export_dataset", out, "--formats", "hf", "--filter", "source=precollected")
    cache = str(tmp_path / "hf-cache")  # a fresh cache: the library keys it by files, not content
    ok, bad = _load(out, "successes", cache), _load(out, "failures", cache)
    assert (len(ok), len(bad)) == (3, 2)
    first = ok[0]
    assert (first["trajectory_id"], first["step_index"], first["task"]) == (
        imported[0].pk,
        0,
        f"osworld/{TASK_ID}",
    )
    assert (
        first["action_type"] == "click" and first["reward"] == 1.0 and first["thought"] == "I act 1"
    )
    assert isinstance(first["image"], Image.Image)
    assert first["image"].convert("RGB").getpixel((1, 1)) == COLORS[0]
    assert [r["action_type"] for r in bad] == ["click", "call_user"]
    card = (out / "README.md").read_text()
    assert "config_name: successes" in card and "| successes | 3 |" in card
    assert "source=precollected" in card and "license: other" in card


@pytest.mark.slow  # loads the shipped policy
def test_sft_view_renders_with_the_policy_s_own_chat_template(tmp_path, imported):
    out = tmp_path / "export"
    call_command("export_dataset", out, "--formats", "sft", "--filter", "status=succeeded")
    sft = _load(out, "sft", str(tmp_path / "hf-cache"))
    assert len(sft) == 3
    row = sft[1]  # the second step: the first one's screen and reply in its history
    # Run-less demonstrations are shown as the default run config's policy sees them.
    policy = load_policy(policy_path("shipped"))
    messages = [{"role": m["role"], "content": [{"type": p["type"], "text": p["text"]} if p["type"] == "text"
                                                 else {"type": "image"} for p in m["content"]]}
                for m in row["messages"]]  # fmt: skip
    text = policy.tokenizer.apply_chat_template(
        messages, chat_template=policy.chat_template, tokenize=False
    )
    assert messages[-1]["role"] == "assistant"
    assert messages[-1]["content"][0]["text"].startswith("Action: type(content='hi there')")
    assert text.count("<|vision_start|>") == len(row["images"]) == 2
    assert "Do it" in text  # the task's instruction, as the policy's prompt puts it
    pixels = policy.image_processor(images=row["images"], return_tensors="pt")
    assert pixels["image_grid_thw"].shape[0] == 2


def test_osworld_export_imports_back_to_the_same_steps(tmp_path, imported):
    out = tmp_path / "export"
    call_command("export_dataset", out, "--formats", "osworld")
    folders = sorted(out.glob("osworld/pyautogui/screenshot/*/osworld/*"))
    assert [f.name for f in folders] == [TASK_ID, TASK_ID]
    before = {t.pk: list(t.steps.order_by("index")) for t in imported}
    Trajectory.objects.all().delete()
    call_command("import_demos", out, "--format", "osworld")
    again = list(Trajectory.objects.order_by("reward"))
    assert [t.reward for t in again] == [0.0, 1.0]
    for new, old in zip(again, [imported[1], imported[0]], strict=True):
        steps = list(new.steps.order_by("index"))
        assert [(s.action, s.thought) for s in steps] == [
            (s.action, s.thought) for s in before[old.pk]
        ]
        assert [color_of(s) for s in steps] == [color_of(s) for s in before[old.pk]]
        assert new.instruction == old.instruction


def test_export_refuses_a_bad_filter_and_a_full_folder(tmp_path, imported):
    with pytest.raises(CommandError, match="reward_min"):
        call_command("export_dataset", tmp_path / "x", "--filter", "reward_min=lots")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(CommandError, match="not empty"):
        call_command("export_dataset", tmp_path / "full")


def test_browser_export_runs_in_the_background_and_downloads(ada_client, tmp_path, imported):
    r = ada_client.post("/exports/", {"query": "status=succeeded", "formats": ["hf", "osworld"]})
    export = DatasetExport.objects.get()
    assert r.status_code == 302 and r["Location"] == f"/exports/{export.pk}/"
    assert (export.status, export.total) == ("queued", 1)
    assert "queued" in ada_client.get(r["Location"]).content.decode()
    dataset_export_run(export_id=export.pk)  # what the default queue's worker runs
    page = ada_client.get(r["Location"]).content.decode()
    assert "1 of 1 trajectories" in page and f"/exports/{export.pk}/download/" in page
    zipped = b"".join(ada_client.get(f"/exports/{export.pk}/download/").streaming_content)
    names = zipfile.ZipFile(io.BytesIO(zipped)).namelist()
    top = f"dartboard-export-{export.pk}/"
    assert top + "README.md" in names and any(n.startswith(top + "successes/part-") for n in names)
    assert any(n.endswith(f"/{TASK_ID}/traj.jsonl") for n in names)


def test_a_failed_export_says_why(ada_client, imported, monkeypatch):
    ada_client.post("/exports/", {"query": "", "formats": ["hf"]})
    export = DatasetExport.objects.get()

    def broken(*a, **kw):
        raise OSError("No space left on device")

    monkeypatch.setattr("datamanager.services.datasets.dataset_write", broken)
    with pytest.raises(OSError):
        dataset_export_run(export_id=export.pk)
    page = ada_client.get(f"/exports/{export.pk}/").content.decode()
    assert "failed" in page and "OSError: No space left on device" in page
    assert ada_client.get(f"/exports/{export.pk}/download/").status_code == 404


def test_an_unknown_format_is_refused(ada_client, imported):
    r = ada_client.post("/exports/", {"query": "", "formats": ["csv"]}, follow=True)
    assert "Not exported: choose formats among hf, sft, osworld" in r.content.decode()
    assert not DatasetExport.objects.exists()
