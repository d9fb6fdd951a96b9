"""The most frequent metric of each of the wheel's metric modules scores real files made here
(openpyxl, python-pptx, python-docx, PyMuPDF, Pillow) through the metric process: 1 for the
gold file, less for a wrong one. The evaluator reads them with the wheel's own `cache_file`
getter, as it reads what another getter fetched from a desktop."""

from __future__ import annotations

import docx
import openpyxl
import pymupdf
import pytest
from PIL import Image, ImageDraw
from pptx import Presentation

from envmanager.osworld_evaluator import WheelEnv, evaluate_task


def _env(cache_dir) -> WheelEnv:
    return WheelEnv("127.0.0.1", 9, None, None, cache_dir=str(cache_dir))


def _score(tmp_path, func: str, suffix: str, options: dict) -> float:
    evaluator = {
        "func": func,
        "result": {"type": "cache_file", "path": f"result{suffix}"},
        "expected": {"type": "cache_file", "path": f"gold{suffix}"},
        "options": options,
    }
    return evaluate_task(evaluator, env=_env(tmp_path), last_action=None).reward


def _xlsx(path, rows):
    book = openpyxl.Workbook()
    for row in rows:
        book.active.append(row)
    book.save(path)


def _pptx(path, title):
    deck = Presentation()
    slide = deck.slides.add_slide(deck.slide_layouts[0])
    slide.shapes.title.text = title
    deck.save(path)


def _docx(path, text):
    document = docx.Document()
    document.add_paragraph(text)
    document.save(path)


def _pdf(path, text):
    pdf = pymupdf.open()
    pdf.new_page().insert_text((72, 72), text)
    pdf.save(path)


def _png(path, box):
    image = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(image).rectangle(box, fill="black")
    image.save(path, format="PNG")


CASES = {
    # table.py: compare_table, 60 of OSWorld's 369 test tasks
    "compare_table": (
        ".xlsx",
        lambda p: _xlsx(p, [["item", "price"], ["tea", 3], ["total", 3]]),
        lambda p: _xlsx(p, [["item", "price"], ["tea", 3], ["total", 4]]),
        {"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]},
    ),
    # slides.py: compare_pptx_files, 38 tasks
    "compare_pptx_files": (
        ".pptx",
        lambda p: _pptx(p, "Quarterly review"),
        lambda p: _pptx(p, "Quarterly preview"),
        {},
    ),
    # docs.py: compare_docx_files, 14 tasks
    "compare_docx_files": (
        ".docx",
        lambda p: _docx(p, "The meeting moved to Friday."),
        lambda p: _docx(p, "The meeting moved to Monday."),
        {},
    ),
    # chrome.py: compare_pdfs, 9 tasks
    "compare_pdfs": (
        ".pdf",
        lambda p: _pdf(p, "Invoice 42: paid"),
        lambda p: _pdf(p, "Invoice 42: overdue, reminder sent"),
        {},
    ),
    # vlc.py / gimp.py: compare_images, 7 tasks
    "compare_images": (
        ".png",
        lambda p: _png(p, (8, 8, 40, 40)),
        lambda p: _png(p, (30, 2, 62, 60)),
        {},
    ),
}


@pytest.mark.parametrize("func", sorted(CASES))
def test_the_gold_file_scores_one_and_a_wrong_one_less(tmp_path, func):
    suffix, make_gold, make_wrong, options = CASES[func]
    make_gold(tmp_path / f"gold{suffix}")
    make_gold(tmp_path / f"result{suffix}")
    assert _score(tmp_path, func, suffix, options) == 1.0
    make_wrong(tmp_path / f"result{suffix}")
    assert _score(tmp_path, func, suffix, options) < 0.99
