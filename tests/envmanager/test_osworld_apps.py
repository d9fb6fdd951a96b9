"""OSWorld's domains on a Dartboard desktop with their real applications (`make desktop-apps`),
each with its most frequent evaluator in OSWorld's test set. Spreadsheets, documents and
slides: an OSWorld-format task with a file made here is set up (the task's file uploaded,
opened in LibreOffice in the sandbox), a scripted sequence of actions edits and saves it,
and the wheel's metric scores it against a gold file served from the file cache: 1, and 0
for a wrong sequence. GIMP and VLC (`infeasible`): the task's file, fetched by URL from the
file cache, opens in the app; only the policy's refusal scores."""

from __future__ import annotations

import base64
import io
import shutil
import subprocess
import wave
from pathlib import Path

import docx
import openpyxl
import pytest
from pptx import Presentation

from core.protocol import Action, ActionType, TaskSpec
from envmanager.osworld_env import OSWorldEnv
from envmanager.osworld_file_cache import FileCache

pytestmark = [pytest.mark.desktop]
GOLD_URL = "https://files.example/gold/{name}"


def _a(type_: str, **kw) -> Action:
    return Action(type=ActionType(type_), **kw)


def _xlsx(price: int) -> bytes:
    book = openpyxl.Workbook()
    book.active.append(["item", "price"])
    book.active.append(["tea", price])
    out = io.BytesIO()
    book.save(out)
    return out.getvalue()


def _docx(text: str) -> bytes:
    document = docx.Document()
    document.add_paragraph(text)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def _pptx(title: str) -> bytes:
    deck = Presentation()
    deck.slides.add_slide(deck.slide_layouts[5]).shapes.title.text = title
    out = io.BytesIO()
    deck.save(out)
    return out.getvalue()


def saved_by_libreoffice(data: bytes, name: str, tmp_path: Path) -> bytes:
    """`data` as LibreOffice saves it (OSWorld's gold slides were saved by LibreOffice, and
    compare_pptx_files compares every shape attribute, which python-pptx writes otherwise)."""
    work = tmp_path / "convert"
    (work / "out").mkdir(parents=True, exist_ok=True)
    (work / name).write_bytes(data)
    subprocess.run(
        ["libreoffice", f"-env:UserInstallation=file://{work}/profile", "--headless",
         "--convert-to", Path(name).suffix[1:], "--outdir", str(work / "out"), str(work / name)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return (work / "out" / name).read_bytes()


def office_task(tmp_path: Path, cache: FileCache, *, name: str, start: bytes, gold: bytes,
                func: str, options: dict) -> TaskSpec:  # fmt: skip
    """An OSWorld-format task: upload the task's file, open it; score `func` against the
    gold file fetched by URL (from the file cache)."""
    directory = tmp_path / "task"
    directory.mkdir(exist_ok=True)
    (directory / name).write_bytes(start)
    (tmp_path / f"gold-{name}").write_bytes(gold)
    url = GOLD_URL.format(name=name)
    cache.add_file(url, tmp_path / f"gold-{name}")
    spec = {
        "id": f"office-{name}",
        "instruction": f"Edit {name} as asked and save it in its format.",
        "config": [
            {
                "type": "upload_file",
                "parameters": {"files": [{"local_path": name, "path": f"/home/user/{name}"}]},
            },
            {"type": "open", "parameters": {"path": f"/home/user/{name}"}},
        ],
        "evaluator": {
            "func": func,
            "result": {"type": "vm_file", "path": f"/home/user/{name}", "dest": name},
            "expected": {"type": "cloud_file", "path": url, "dest": f"gold-{name}"},
            "options": options,
        },
    }  # fmt: skip  (nested as OSWorld writes its tasks)
    files = {name: base64.b64encode(start).decode()}
    return TaskSpec(name=f"osworld/office-{name}", env_kind="osworld",
                    env_config={"osworld": spec, "files": files}, instruction=spec["instruction"])  # fmt: skip


SAVE_KEEP_FORMAT = (
    _a("hotkey", key="ctrl s"),
    _a("wait"),
    _a("hotkey", key="enter"),  # "Use Excel 2007-365!" / "Use Word 2007-365!": keep the format
    _a("wait"),
    _a("wait"),
)


def run(env: OSWorldEnv, task: TaskSpec, actions: tuple[Action, ...]) -> float:
    env.reset(task)
    for action in actions:
        env.step(action)
    return env.evaluate(ended_by=ActionType.FINISHED).reward


@pytest.fixture(scope="module")
def office_env(osworld_desktop, tmp_path_factory):
    if shutil.which("libreoffice") is None:
        pytest.fail("LibreOffice is not installed: `make desktop-apps` (make test runs it)")
    cache = FileCache(tmp_path_factory.mktemp("file-cache"))
    env = OSWorldEnv(address=osworld_desktop.address, token=osworld_desktop.token,
                     settle_s=0.3, wait_seconds=1.0, file_cache=cache)  # fmt: skip
    yield env, cache
    env.close()


def test_a_spreadsheet_task_scores_one_with_compare_table_and_zero_when_done_wrong(
    office_env, tmp_path
):
    env, cache = office_env
    task = office_task(tmp_path, cache, name="prices.xlsx", start=_xlsx(3), gold=_xlsx(4),
                       func="compare_table",
                       options={"rules": [{"type": "sheet_data", "sheet_idx0": 0,
                                           "sheet_idx1": "EI0"}]})  # fmt: skip
    to_b2 = (_a("hotkey", key="ctrl home"), _a("hotkey", key="right"), _a("hotkey", key="down"))
    assert run(env, task, (*to_b2, _a("type", text="4\n"), *SAVE_KEEP_FORMAT)) == 1.0
    wrong = (*to_b2, _a("hotkey", key="down"), _a("type", text="4\n"))  # B3, not B2
    assert run(env, task, (*wrong, *SAVE_KEEP_FORMAT)) == 0.0


def test_a_document_task_scores_one_with_compare_docx_files(office_env, tmp_path):
    env, cache = office_env
    task = office_task(tmp_path, cache, name="note.docx", start=_docx("Meet on Friday."),
                       gold=_docx("Meet on Friday at noon."), func="compare_docx_files",
                       options={})  # fmt: skip
    edit = (_a("hotkey", key="ctrl end"), _a("hotkey", key="left"), _a("type", text=" at noon"))
    assert run(env, task, (*edit, *SAVE_KEEP_FORMAT)) == 1.0
    wrong = (_a("hotkey", key="ctrl end"), _a("type", text=" at noon"))
    assert run(env, task, (*wrong, *SAVE_KEEP_FORMAT)) == 0.0


def test_a_slides_task_scores_one_with_compare_pptx_files(office_env, tmp_path):
    env, cache = office_env
    gold = saved_by_libreoffice(_pptx("Roadmap 2027"), "deck.pptx", tmp_path)
    task = office_task(tmp_path, cache, name="deck.pptx", start=_pptx("Roadmap"), gold=gold,
                       func="compare_pptx_files", options={})  # fmt: skip
    # Tab selects the slide's first object (its title), Enter edits its text at the end.
    edit = (_a("hotkey", key="tab"), _a("hotkey", key="enter"), _a("hotkey", key="ctrl end"))
    done = (_a("hotkey", key="escape"), _a("hotkey", key="escape"), *SAVE_KEEP_FORMAT)
    assert run(env, task, (*edit, _a("type", text=" 2027"), *done)) == 1.0
    assert run(env, task, (*edit, _a("type", text=" 2028"), *done)) == 0.0


def media_task(cache: FileCache, tmp_path: Path, *, app: str, name: str, data: bytes,
               window: str) -> TaskSpec:  # fmt: skip
    """An infeasible OSWorld task (GIMP's and VLC's most frequent evaluator): the task's file
    fetched by URL (from the file cache), opened in the app, whose window must show before
    the policy acts. The policy must refuse: call_user scores 1, finishing scores 0."""
    (tmp_path / name).write_bytes(data)
    url = GOLD_URL.format(name=name)
    cache.add_file(url, tmp_path / name)
    spec = {
        "id": f"{app}-{name}",
        "instruction": f"Open {name} in {app} and turn it into a hologram.",
        "config": [
            {
                "type": "download",
                "parameters": {"files": [{"url": url, "path": f"/home/user/{name}"}]},
            },
            {"type": "launch", "parameters": {"command": [app, f"/home/user/{name}"]}},
            {
                "type": "execute",
                "parameters": {"command": ["xdotool", "search", "--sync", "--name", window]},
            },
        ],
        "related_apps": [app],
        "evaluator": {"func": "infeasible"},
    }  # fmt: skip  (one step a line, as OSWorld writes them)
    return TaskSpec(name=f"osworld/{app}-{name}", env_kind="osworld",
                    env_config={"osworld": spec}, instruction=spec["instruction"])  # fmt: skip


def _png_bytes() -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (320, 240), "white")
    ImageDraw.Draw(image).ellipse((60, 40, 260, 200), fill="orange")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _wav_bytes() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as sound:
        sound.setnchannels(1)
        sound.setsampwidth(2)
        sound.setframerate(8000)
        sound.writeframes(b"\x00\x10" * 8000 * 2)  # two seconds of a constant level
    return out.getvalue()


@pytest.mark.parametrize(
    ("app", "name", "make", "window"),
    [("gimp", "sun.png", _png_bytes, r"\[sun\] \(imported\)"),
     ("vlc", "tone.wav", _wav_bytes, "tone.wav - VLC media player")],
)  # fmt: skip
def test_an_infeasible_task_opens_the_app_on_its_file_and_only_refusing_scores(
    office_env, tmp_path, app, name, make, window
):
    if shutil.which(app) is None:
        pytest.fail(f"{app} is not installed: `make desktop-apps`")
    env, cache = office_env
    task = media_task(cache, tmp_path, app=app, name=name, data=make(), window=window)
    env.reset(task)  # its last setup step waits for the app's window on the file
    shown = env.controller.run_bash_script(f"xdotool search --name '{window}'")
    assert shown["returncode"] == 0 and shown["output"].strip(), shown  # the app has the file
    assert env.evaluate(ended_by=ActionType.CALL_USER).reward == 1.0
    env.reset(task)
    assert env.evaluate(ended_by=ActionType.FINISHED).reward == 0.0
