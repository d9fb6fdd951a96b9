"""Importing demonstrations as other projects write them: OSWorld result folders and AgentNet
lines, from the command line and the upload page; bad inputs refused whole, with the message
a user needs; the review queue; duplicates found by content."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
from django.core.files.storage import default_storage
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command
from PIL import Image

from core.imaging import QWEN25_VL, ImageGeometry
from core.prompts import PROMPT_TEMPLATES
from datamanager.models import Task, Trajectory
from datamanager.selectors.steps import step_reply
from tests.conftest import png_bytes
from tests.dartboard.test_curation_views import media_files

pytestmark = pytest.mark.django_db

TASK_ID = "bb5e4c0d-f964-439c-97b6-bdb9747de3f4"
COLORS = [(200, 0, 0), (0, 200, 0), (0, 0, 200), (200, 200, 0), (0, 200, 200)]


@pytest.fixture
def osworld_task(db) -> Task:
    return Task.objects.create(name=f"osworld/{TASK_ID}", env_kind="osworld", instruction="Do it")


def osworld_folder(
    root: Path,
    actions: list[str],
    *,
    first_screen: bool = True,
    size: tuple[int, int] = (320, 180),
    score: str = "1.0\n",
    task_id: str = TASK_ID,
) -> Path:
    """A result folder as OSWorld's lib_run_single writes it (step_0.png as some agents add)."""
    folder = root / "results" / "pyautogui" / "screenshot" / "uitars" / "chrome" / task_id
    folder.mkdir(parents=True)
    if first_screen:
        (folder / "step_0.png").write_bytes(png_bytes(*size, color=COLORS[0]))
    with (folder / "traj.jsonl").open("w") as fh:
        for i, code in enumerate(actions, start=1):
            stamp = f"20260101@0000{i:02d}"
            shot = f"step_{i}_{stamp}.png"
            (folder / shot).write_bytes(png_bytes(*size, color=COLORS[i % len(COLORS)]))
            fh.write(json.dumps({"step_num": i, "action_timestamp": stamp, "action": code,
                                 "response": f"I act {i}", "reward": 0, "done": code == "DONE",
                                 "info": {}, "screenshot_file": shot}) + "\n")  # fmt: skip
    (folder / "result.txt").write_text(score)
    return root


def color_of(step) -> tuple[int, int, int]:
    with default_storage.open(step.screenshot.name) as fh, Image.open(fh) as img:
        return img.convert("RGB").getpixel((1, 1))


def test_osworld_folders_import_with_each_action_on_the_screen_before_it(tmp_path, osworld_task):
    code = ["pyautogui.click(100, 50)", "pyautogui.moveTo(10, 20)\npyautogui.click()",
            "pyautogui.typewrite('hello', interval=0.05)\npyautogui.press('enter')", "DONE"]  # fmt: skip
    call_command("import_demos", osworld_folder(tmp_path, code), "--format", "osworld")
    traj = Trajectory.objects.get()
    steps = list(traj.steps.order_by("index"))
    assert [s.action for s in steps] == [
        {"type": "click", "x": 100, "y": 50},
        {"type": "click", "x": 10, "y": 20},
        {"type": "type", "text": "hello"},
        {"type": "hotkey", "key": "enter"},
        {"type": "finished"},
    ]
    # Action N is paired with the screen saved after action N-1 (step_0 before the first);
    # the two actions of one line's code share the screen before that line.
    assert [color_of(s) for s in steps] == [COLORS[0], COLORS[1], COLORS[2], COLORS[2], COLORS[3]]
    assert (traj.task, traj.reward, traj.status, traj.source) == (
        osworld_task,
        1.0,
        "succeeded",
        "precollected",
    )
    assert traj.instruction == "Do it" and steps[0].thought == "I act 1"
    # Not accepted: it waits in the review queue, out of the pool.
    assert (traj.in_pool, traj.reviewed_at) == (False, None)


def test_without_the_first_screen_the_first_action_is_left_out_and_said(
    tmp_path, osworld_task, capsys
):
    code = ["pyautogui.moveTo(30, 40)", "pyautogui.click()", "DONE"]
    call_command(
        "import_demos", osworld_folder(tmp_path, code, first_screen=False), "--format", "osworld"
    )
    steps = list(Trajectory.objects.get().steps.order_by("index"))
    # The left-out moveTo still placed the cursor the next click uses.
    assert [s.action for s in steps] == [{"type": "click", "x": 30, "y": 40}, {"type": "finished"}]
    assert [color_of(s) for s in steps] == [COLORS[1], COLORS[2]]
    assert "the first action is left out" in capsys.readouterr().out


def test_points_are_rescaled_when_screenshots_are_smaller_than_the_screen(tmp_path, osworld_task):
    root = osworld_folder(tmp_path, ["pyautogui.click(1000, 500)", "DONE"], size=(960, 540))
    call_command("import_demos", root, "--format", "osworld", "--screen", "1920x1080")
    first = Trajectory.objects.get().steps.get(index=0)
    assert first.action == {"type": "click", "x": 500, "y": 250}
    assert (first.screen_width, first.screen_height) == (960, 540)


def test_accept_pools_and_the_same_episode_twice_is_skipped(tmp_path, osworld_task, capsys):
    root = osworld_folder(tmp_path, ["pyautogui.click(10, 10)", "DONE"])
    call_command("import_demos", root, "--format", "osworld", "--accept")
    traj = Trajectory.objects.get()
    assert traj.in_pool and traj.reviewed_at is not None
    call_command("import_demos", root, "--format", "osworld")
    assert Trajectory.objects.count() == 1
    assert "already imported (same content)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: f.joinpath("traj.jsonl").write_text(
            json.dumps({"step_num": 1, "action": "pyautogui.tripleClick(5, 5)", "screenshot_file": "step_1_x.png"}) + "\n"),
         "traj.jsonl:1: line 1: 'pyautogui.tripleClick(5, 5)'"),
        (lambda f: f.joinpath("traj.jsonl").write_text(
            json.dumps({"step_num": 1, "action": "import os; os.system('id')", "screenshot_file": "step_1_x.png"}) + "\n"),
         "traj.jsonl:1: line 1"),
        (lambda f: f.joinpath("result.txt").unlink(), "result.txt: missing (the episode was never scored)"),
        (lambda f: next(f.glob("step_1_*.png")).unlink(), "step_1_20260101@000001.png: cannot be read"),
        (lambda f: next(f.glob("step_1_*.png")).write_bytes(b"\x89PNG\r\n\x1a\n broken"), "is not a readable image"),
        (lambda f: f.joinpath("traj.jsonl").write_text("{not json\n"), "traj.jsonl:1: not JSON"),
    ],
)  # fmt: skip
def test_a_bad_folder_imports_nothing_and_says_where(tmp_path, osworld_task, edit, message):
    good = osworld_folder(tmp_path / "a", ["pyautogui.click(10, 10)", "DONE"], task_id=TASK_ID)
    bad = good / "results" / "pyautogui" / "screenshot" / "uitars" / "chrome" / "second"
    bad.mkdir()
    for f in (
        good / "results" / "pyautogui" / "screenshot" / "uitars" / "chrome" / TASK_ID
    ).iterdir():
        bad.joinpath(f.name).write_bytes(f.read_bytes())
    edit(bad)
    before = media_files()
    with pytest.raises(CommandError, match="nothing was imported") as exc:
        call_command("import_demos", good, "--format", "osworld", "--task", osworld_task.name)
    assert message in str(exc.value)
    assert not Trajectory.objects.exists() and media_files() == before


def test_an_unknown_task_names_the_close_ones(tmp_path, osworld_task):
    root = osworld_folder(tmp_path, ["DONE"], task_id=TASK_ID[:-1] + "5")
    with pytest.raises(CommandError, match="close names: osworld/" + TASK_ID):
        call_command("import_demos", root, "--format", "osworld")


def test_a_100_megapixel_png_is_refused_before_it_is_decoded(tmp_path, osworld_task):
    root = osworld_folder(tmp_path, ["pyautogui.click(10, 10)", "DONE"])
    buf = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buf, "PNG")  # 100 Mpx in a few KB
    next(root.rglob("step_1_*.png")).write_bytes(buf.getvalue())
    with pytest.raises(CommandError, match="10000x10000 is more than 16777216 pixels"):
        call_command("import_demos", root, "--format", "osworld")
    assert not Trajectory.objects.exists()


# --- AgentNet -----------------------------------------------------------------------------


def agentnet_source(
    root: Path, *, completed: bool = True, code1: str = "pyautogui.click(x=0.25, y=0.5)"
) -> Path:
    """A line as OpenCUA's AgentNet release writes it, its images in images/."""
    (root / "images").mkdir(parents=True)
    for i, color in enumerate(COLORS[:3]):
        (root / "images" / f"shot-{i}.png").write_bytes(png_bytes(400, 200, color=color))
    line = {"task_id": "agentnet-7", "instruction": "Open the file", "task_completed": completed,
            "alignment_score": 8, "efficiency_score": 7, "task_difficulty": 3, "natural_language_task": "x",
            "actual_task": "y", "reason": "z",
            "traj": [{"index": 0, "image": "shot-0.png", "value": {"code": code1, "thought": "The icon",
                                                                   "action": "Click", "observation": "o"}},
                     {"index": 1, "image": "shot-1.png", "value": {"code": "pyautogui.write(message='notes.txt')\npyautogui.press('enter')",
                                                                   "thought": "Type it"}},
                     {"index": 2, "image": "shot-2.png", "value": {"code": "computer.terminate(status='success')", "thought": "Done"}}]}  # fmt: skip
    (root / "agentnet_ubuntu.jsonl").write_text(json.dumps(line) + "\n")
    return root


def test_agentnet_lines_import_with_fractional_points_scaled(tmp_path, db):
    task = Task.objects.create(name="agentnet-7", env_kind="desktop")
    call_command("import_demos", agentnet_source(tmp_path), "--format", "agentnet", "--accept")
    traj = Trajectory.objects.get()
    steps = list(traj.steps.order_by("index"))
    assert [s.action for s in steps] == [
        {"type": "click", "x": 100, "y": 100},
        {"type": "type", "text": "notes.txt"},
        {"type": "hotkey", "key": "enter"},
        {"type": "finished"},
    ]
    assert [color_of(s) for s in steps] == [COLORS[0], COLORS[1], COLORS[1], COLORS[2]]
    assert (traj.task, traj.reward, traj.in_pool, traj.instruction) == (
        task,
        1.0,
        True,
        "Open the file",
    )
    assert '"alignment_score": 8' in traj.details["import"]["notes"][0]


def test_agentnet_errors_name_the_line_and_the_step(tmp_path, db):
    Task.objects.create(name="agentnet-7", env_kind="desktop")
    root = agentnet_source(tmp_path, code1="pyautogui.click(x=3.5, y=0.5)")
    with pytest.raises(CommandError) as exc:
        call_command("import_demos", root, "--format", "agentnet")
    assert "agentnet_ubuntu.jsonl:1: traj[0].value.code: line 1" in str(exc.value)
    assert "outside" in str(exc.value)
    assert not Trajectory.objects.exists()


# --- the upload page ----------------------------------------------------------------------


def zipped(root: Path, extra: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for p in root.rglob("*"):
            if p.is_file():
                zf.write(p, p.relative_to(root).as_posix())
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return buf.getvalue()


def post(client, data: bytes, fmt: str, **fields):
    f = SimpleUploadedFile("demos.zip", data, content_type="application/zip")
    return client.post("/trajectories/upload/", {"archive": f, "format": fmt, **fields})


def test_upload_page_imports_osworld_folders_into_the_review_queue(
    ada_client, tmp_path, osworld_task
):
    r = post(
        ada_client, zipped(osworld_folder(tmp_path, ["pyautogui.click(10, 10)", "DONE"])), "osworld"
    )
    assert (
        r.status_code == 302 and r["Location"] == "/trajectories/?source=precollected&reviewed=no"
    )
    queue = ada_client.get(r["Location"]).content.decode()
    traj = Trajectory.objects.get()
    assert f"/trajectories/{traj.pk}/" in queue
    # Accepting it from its page takes it out of the queue and into the pool.
    ada_client.post(f"/trajectories/{traj.pk}/promote/")
    traj.refresh_from_db()
    assert traj.in_pool and traj.reviewed_by is not None
    assert f"/trajectories/{traj.pk}/" not in ada_client.get(r["Location"]).content.decode()


def test_upload_of_a_zip_with_path_traversal_is_refused(ada_client, tmp_path, osworld_task):
    data = zipped(osworld_folder(tmp_path, ["DONE"]), extra={"../../etc/evil.png": png_bytes()})
    r = post(ada_client, data, "osworld")
    html = r.content.decode().replace("&#x27;", "'")
    assert r.status_code == 400 and "leaves the source" in html and "nothing was imported" in html
    assert not Trajectory.objects.exists()


# --- training on them ---------------------------------------------------------------------


def test_an_imported_step_trains_on_its_action_in_the_policy_s_coordinates(tmp_path, osworld_task):
    call_command("import_demos", osworld_folder(tmp_path, ["pyautogui.click(160, 90)", "DONE"]),
                 "--format", "osworld")  # fmt: skip
    traj = Trajectory.objects.get()
    step = traj.steps.get(index=0)
    # A policy whose processor halves the 320x180 screen: the reply is in its pixels.
    factor = QWEN25_VL.factor
    half = ImageGeometry(factor=factor, min_pixels=factor * factor, max_pixels=160 * 90)
    reply = step_reply(
        traj, step, geometry=half, template=PROMPT_TEMPLATES["ui-tars-1.5"], coords="pixel"
    )
    assert reply.startswith("Thought: I act 1\nAction: click(start_box='<|box_start|>(")
    assert "(160,90)" not in reply  # not the screen's pixels
    plain = step_reply(
        traj, step, geometry=half, template=PROMPT_TEMPLATES["dartboard"], coords="pixel"
    )
    assert plain.startswith("Action: click(")
