"""OSWorld's spreadsheet, document and slides tasks on a Dartboard desktop with the real
LibreOffice (`make desktop-apps`): an OSWorld-format task with a file made here is set up
(the task's file uploaded, opened in LibreOffice in the sandbox), a scripted sequence of
actions edits and saves it, and the domain's most frequent metric of OSWorld's wheel scores
it against a gold file served from the file cache: 1, and 0 for a wrong sequence."""

from __future__ import annotations

import base64
import io
import shutil
import subprocess
from pathlib import Path

import docx
import openpyxl
import pytest
from pptx import Presentation

from core.protocol import Action, ActionType, TaskSpec
from envmanager.osworld_env import OSWorldEnv
from envmanager.osworld_file_cache import FileCache

pytestmark = [
    pytest.mark.desktop,
    pytest.mark.skipif(
        shutil.which("libreoffice") is None,
        reason="LibreOffice is not installed: `make desktop-apps` (make test installs it)",
    ),
]
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
