"""OSWorld evaluators run outside the sandbox: a metric that would import, run or write what
the agent (or the task) supplies is refused at task import, with its name and why, and again
by the evaluator; so is a getter whose cache file name is a path. A metric that reads a
file the agent made runs in a process of its own under memory, CPU and wall-clock limits:
a zip bomb or an endless PDF scores 0 with the limit named, and the env worker stays small.

The evaluator calls here use the wheel's own `cache_file` getter (it reads a file of the
evaluator's cache directory), so the metric under test gets real files and no desktop is
needed: the files below are what an agent could have written, and before the refusal the
wheel's check_python_file_by_test_suite imported and ran the test file in this process.
"""

from __future__ import annotations

import inspect
import io
import json
import re
import struct
import sys
import tarfile
import time
import tokenize
import zipfile
import zlib
from pathlib import Path

import docx
import pytest

from core.protocol import EnvUnavailable
from datamanager.task_import import InvalidTaskRecord, read_task_file
from envmanager.osworld_evaluator import WheelEnv, evaluate_task
from envmanager.osworld_metric_process import MetricFailed, MetricLimits, metric_score
from envmanager.osworld_metric_review import (
    REFUSED_GETTERS,
    REFUSED_METRICS,
    SAFE_METRICS,
    SCRATCH_METRICS,
)
from envmanager.osworld_wheel import METRICS, exported_names, wheel

EXEC_METRIC = "check_python_file_by_test_suite"
# What a metric must not do in the env worker, as it reads in the wheel's source.
RUNS_CODE = re.compile(
    r"exec_module|\bexec\(|\beval\(|subprocess|os\.system|os\.popen|pickle|importlib|runpy"
    r"|__import__|(?<![\w.])compile\(|yaml\.load\(|yaml\.unsafe_load|sqlite3|open\([^)]*['\"][wa]b?['\"]"
)


def _task(evaluator: dict) -> dict:
    return {
        "id": "agent-test-suite",
        "instruction": "Fix ~/solution.py so that its tests pass.",
        "config": [],
        "related_apps": ["vs_code"],
        "evaluator": evaluator,
    }


TEST_SUITE = {
    "func": EXEC_METRIC,
    "result": {"type": "cache_file", "path": "solution.py"},
    "expected": {"type": "cache_file", "path": "test_suite.py"},
}


def _env(cache_dir) -> WheelEnv:
    # No desktop behind it: the refusal must come before any getter or controller is used.
    return WheelEnv(
        vm_ip="127.0.0.1",
        server_port=9,
        controller=None,
        setup_controller=None,
        cache_dir=str(cache_dir),
    )


def test_importing_a_task_that_execs_agent_code_is_refused_with_the_metrics_name(tmp_path):
    path = tmp_path / "agent-test-suite.json"
    path.write_text(json.dumps(_task(TEST_SUITE)))
    with pytest.raises(InvalidTaskRecord) as err:
        read_task_file(path)
    message = str(err.value)
    assert f"{path}: evaluator.func: metric '{EXEC_METRIC}' is refused: " in message
    assert "exec_module" in message and "outside the sandbox" in message
    # The same object as a Dartboard record (env_kind osworld) is refused the same way.
    record = tmp_path / "tasks.jsonl"
    record.write_text(
        json.dumps(
            {
                "name": "osworld/agent-test-suite",
                "env_kind": "osworld",
                "env_config": {"osworld": _task({**TEST_SUITE, "func": [EXEC_METRIC]})},
            }
        )
    )
    with pytest.raises(InvalidTaskRecord, match=rf"evaluator\.func\[0\]: metric '{EXEC_METRIC}'"):
        read_task_file(record)


def test_the_evaluator_refuses_to_run_an_agents_test_file(tmp_path):
    ran = tmp_path / "ran-on-the-host.txt"
    (tmp_path / "solution.py").write_text("def answer():\n    return 42\n")
    (tmp_path / "test_suite.py").write_text(
        f"open({str(ran)!r}, 'w').write('the agent ran code in the env worker')\n"
        "def test():\n    return True\n"
    )
    with pytest.raises(EnvUnavailable) as err:
        evaluate_task(TEST_SUITE, env=_env(tmp_path), last_action=None)
    assert str(err.value).startswith(f"osworld evaluator: metric '{EXEC_METRIC}' is refused: ")
    assert not ran.exists()
    assert EXEC_METRIC not in wheel().metrics  # not even callable through the wheel


def test_a_getter_file_name_that_is_a_path_is_refused(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (tmp_path / "host-secret.txt").write_text("s3cret")
    peek = {
        "func": "file_contains",
        "result": {"type": "cache_file", "path": "../host-secret.txt"},
        "expected": {"type": "rule", "rules": {"expected": ["s3cret"]}},
    }
    with pytest.raises(EnvUnavailable, match=r"result getter refused: path '\.\./host-secret"):
        evaluate_task(peek, env=_env(cache), last_action=None)
    write = {**peek, "result": {"type": "vm_file", "path": "/home/user/a", "dest": "/etc/x"}}
    path = tmp_path / "write.json"
    path.write_text(json.dumps(_task(write)))
    with pytest.raises(InvalidTaskRecord) as err:
        read_task_file(path)
    assert "evaluator.result: dest '/etc/x' must be a file name" in str(err.value)
    stdout = _task(
        {
            **TEST_SUITE,
            "func": "exact_match",
            "postconfig": [
                {"type": "execute", "parameters": {"command": ["ls"], "stdout": "../../.bashrc"}}
            ],
        }
    )
    path.write_text(json.dumps(stdout))
    with pytest.raises(InvalidTaskRecord, match=r"postconfig\[0\]\.parameters: stdout"):
        read_task_file(path)


def _code(fn) -> str:
    """A function's source without its comments (one safe metric keeps an `eval(` there)."""
    tokens = tokenize.generate_tokens(io.StringIO(inspect.getsource(fn)).readline)
    return tokenize.untokenize((t.type, t.string) for t in tokens if t.type != tokenize.COMMENT)


def test_every_exported_metric_was_reviewed_and_the_safe_ones_run_no_code():
    w = wheel()
    exported = set(exported_names(METRICS))
    reviewed = SAFE_METRICS | set(SCRATCH_METRICS) | set(REFUSED_METRICS)
    assert exported == reviewed  # nothing exported went unread, no stale name in the review
    assert not SAFE_METRICS & (set(SCRATCH_METRICS) | set(REFUSED_METRICS))
    assert set(w.metrics) == SAFE_METRICS | set(SCRATCH_METRICS)  # only those are callable
    assert set(w.refused_metrics) == set(REFUSED_METRICS)
    assert set(REFUSED_GETTERS) <= set(w.getters)
    for name in SAFE_METRICS:
        assert not RUNS_CODE.search(_code(w.metrics[name])), name
    vscode = sys.modules["desktop_env.evaluators.metrics.vscode"]
    assert RUNS_CODE.search(inspect.getsource(getattr(vscode, EXEC_METRIC)))  # the scan sees


# fuzzy_place_math opens the agent's docx with python-docx (the one docx metric the loaded
# modules have): three words, each scored against the task's answers.
DOCX_TASK = {
    "func": "fuzzy_place_math",
    "result": {"type": "cache_file", "path": "places.docx"},
    "expected": {"type": "rule", "rules": {"expected": ["Paris", "Berlin", "Rome"]}},
}
PDF_TASK = {
    "func": "is_gold_text_included_in_pdf",
    "result": {"type": "cache_file", "path": "report.pdf"},
    "expected": {"type": "cache_file", "path": "gold.json"},
}


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert match, field
    return int(match.group(1))


def _write_docx_bomb(path: Path, *, inflated_mib: int) -> None:
    """python-docx's blank document with word/document.xml replaced by `inflated_mib` MiB of
    spaces: one deflate block of 1 MiB, ended by a full flush so that it decodes the same
    wherever it stands, written `inflated_mib` times (a few MiB on disk, a valid zip: its
    CRC is the inflated stream's). The other parts are appended by zipfile."""
    unit = b" " * (1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = deflate.compress(unit) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.flush()
    crc = 0
    for _ in range(inflated_mib):
        crc = zlib.crc32(unit, crc)
    name = b"word/document.xml"
    # version 2.0, no flags, deflated, time 0, date 1980-01-01, crc, sizes, name length, no extra
    entry = struct.pack(
        "<HHHHHIIIHH",
        20,
        0,
        zipfile.ZIP_DEFLATED,
        0,
        0x21,
        crc,
        inflated_mib * len(block) + len(end),
        inflated_mib * len(unit),
        len(name),
        0,
    )
    with path.open("wb") as out:
        out.write(b"PK\x03\x04" + entry + name)
        for _ in range(inflated_mib):
            out.write(block)
        out.write(end)
        central = out.tell()
        out.write(b"PK\x01\x02" + struct.pack("<H", 20) + entry + bytes(14) + name)
        size = out.tell() - central
        out.write(b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, 1, 1, size, central, 0))
    blank = io.BytesIO()
    docx.Document().save(blank)
    with zipfile.ZipFile(blank) as src, zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if item.filename != name.decode():
                dst.writestr(item.filename, src.read(item))


def _write_pdf_of_operators(path: Path, *, operators: int) -> None:
    """A one-page PDF whose content stream is `operators` save/restore pairs ("q Q"), Flate
    compressed: a few KiB on disk; pdfminer interprets each pair in Python."""
    content = zlib.compress(b"q Q\n" * operators, 9)
    bodies = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << >> >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(content), content),
    ]
    pdf = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(bodies, 1):
        offsets.append(len(pdf))
        pdf += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(pdf)
    pdf += b"xref\n0 %d\n0000000000 65535 f \n" % (len(bodies) + 1)
    pdf += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    pdf += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(bodies) + 1,
        xref,
    )
    path.write_bytes(pdf)


@pytest.fixture
def endless_pdf(tmp_path) -> Path:
    """A 40 KiB PDF of 10 million drawing operators (minutes of pdfminer here) and the
    task's gold text, which is not in it."""
    _write_pdf_of_operators(tmp_path / "report.pdf", operators=10_000_000)
    (tmp_path / "gold.json").write_text(json.dumps({"title": "Quarterly report"}))
    return tmp_path


def test_a_correct_docx_scores_one_through_the_metric_process(tmp_path):
    document = docx.Document()
    document.add_paragraph("Paris Berlin Rome")
    document.save(tmp_path / "places.docx")
    evaluation = evaluate_task(DOCX_TASK, env=_env(tmp_path), last_action=None)
    assert (evaluation.reward, evaluation.success) == (1.0, True)
    assert "reason" not in evaluation.details
    # A file that is no docx makes the metric raise: an environment error, as before.
    (tmp_path / "places.docx").write_text("not a zip")
    with pytest.raises(EnvUnavailable, match=r"fuzzy_place_math failed: PackageNotFoundError"):
        evaluate_task(DOCX_TASK, env=_env(tmp_path), last_action=None)


@pytest.mark.slow
def test_a_docx_zip_bomb_scores_zero_at_the_memory_limit_and_the_worker_stays_small(tmp_path):
    _write_docx_bomb(tmp_path / "places.docx", inflated_mib=3 * 1024)
    with zipfile.ZipFile(tmp_path / "places.docx") as bomb:
        assert bomb.getinfo("word/document.xml").file_size == 3 * 1024**3
    assert (tmp_path / "places.docx").stat().st_size < 8 * 1024**2
    wheel()  # the worker has the wheel imported before it evaluates
    rss_before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM: this process's peak from now on
    started = time.monotonic()
    evaluation = evaluate_task(DOCX_TASK, env=_env(tmp_path), last_action=None)
    elapsed = time.monotonic() - started
    assert (evaluation.reward, evaluation.success) == (0.0, False)
    limit = MetricLimits().memory_mb
    assert evaluation.details["reason"] == (
        f"fuzzy_place_math exceeded its {limit} MiB memory limit reading the agent's result"
    )
    assert _status_kib("VmHWM") - rss_before < 200 * 1024
    assert elapsed < 60


@pytest.mark.slow
def test_a_pdf_of_endless_drawing_operators_is_killed_at_the_wall_clock_limit(endless_pdf):
    started = time.monotonic()
    evaluation = evaluate_task(
        PDF_TASK,
        env=_env(endless_pdf),
        last_action=None,
        limits=MetricLimits(wall_seconds=2),
    )
    elapsed = time.monotonic() - started
    assert (evaluation.reward, evaluation.success) == (0.0, False)
    assert evaluation.details["reason"] == (
        "is_gold_text_included_in_pdf exceeded its 2 s wall-clock limit reading the agent's "
        "result (killed)"
    )
    assert elapsed < 30


@pytest.mark.slow
def test_the_same_pdf_stops_at_the_cpu_limit(endless_pdf):
    evaluation = evaluate_task(
        PDF_TASK,
        env=_env(endless_pdf),
        last_action=None,
        limits=MetricLimits(cpu_seconds=1, wall_seconds=120),
    )
    assert evaluation.reward == 0.0
    assert evaluation.details["reason"] == (
        "is_gold_text_included_in_pdf exceeded its 1 s CPU time limit reading the agent's result"
    )


def test_a_value_that_cannot_reach_the_metric_process_is_named():
    with pytest.raises(MetricFailed, match=r"the result value \(generator\) cannot be sent"):
        metric_score(
            "exact_match",
            (line for line in ["x"]),
            {"expected": "x"},
            options={},
            has_expected=True,
        )


def _archive_task(suffix: str) -> dict:
    return {
        "func": "compare_archive",
        "result": {"type": "cache_file", "path": f"agent{suffix}"},
        "expected": {"type": "cache_file", "path": f"gold{suffix}"},
    }


def _tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_an_image_that_is_postscript_is_never_handed_to_ghostscript(tmp_path):
    # Pillow opens a file starting with %!PS as EPS and runs Ghostscript on it to read its
    # pixels; the metric process has that plugin off, so the file is no image at all.
    (tmp_path / "gold.png").write_bytes(_png_bytes())
    (tmp_path / "agent.png").write_text(
        "%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\nnewpath 0 0 moveto showpage\n"
    )
    images = {"func": "compare_images",
              "result": {"type": "cache_file", "path": "agent.png"},
              "expected": {"type": "cache_file", "path": "gold.png"}}  # fmt: skip
    with pytest.raises(EnvUnavailable, match=r"compare_images failed: UnidentifiedImageError"):
        evaluate_task(images, env=_env(tmp_path), last_action=None)


def _png_bytes() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(out, format="PNG")
    return out.getvalue()


def test_a_tar_member_leading_out_of_its_folder_is_not_written(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    _tar(cache / "gold.tar", {"a.txt": b"gold"})
    _tar(cache / "agent.tar", {"a.txt": b"gold", "../../escaped.txt": b"the agent's file"})
    with pytest.raises(EnvUnavailable, match=r"compare_archive failed: OutsideDestinationError"):
        evaluate_task(_archive_task(".tar"), env=_env(cache), last_action=None)
    assert not (tmp_path / "escaped.txt").exists()
    _tar(cache / "agent.tar", {"a.txt": b"gold"})  # the same archive, inside its folder: 1
    assert evaluate_task(_archive_task(".tar"), env=_env(cache), last_action=None).reward == 1.0


def test_what_a_metric_writes_stays_in_its_scratch_directory_and_under_its_size_limit(
    tmp_path, monkeypatch
):
    # compare_zip_files writes each PDF of the zips to temp.pdf in its working directory.
    worker_dir = tmp_path / "worker"
    worker_dir.mkdir()
    monkeypatch.chdir(worker_dir)
    _write_pdf_of_operators(tmp_path / "page.pdf", operators=10)
    for name in ("agent.zip", "gold.zip"):
        with zipfile.ZipFile(tmp_path / name, "w") as archive:
            archive.write(tmp_path / "page.pdf", "report.pdf")
    zips = {"func": "compare_zip_files",
            "result": {"type": "cache_file", "path": "agent.zip"},
            "expected": {"type": "cache_file", "path": "gold.zip"}}  # fmt: skip
    assert evaluate_task(zips, env=_env(tmp_path), last_action=None).reward == 1.0
    assert list(worker_dir.iterdir()) == []  # no temp.pdf where the worker runs
    # An archive that unpacks past the file-size limit is the agent's doing: a score of 0.
    _tar(tmp_path / "gold.tar", {"big.bin": b"0"})
    _tar(tmp_path / "agent.tar", {"big.bin": bytes(3 * 1024 * 1024)})
    evaluation = evaluate_task(
        _archive_task(".tar"), env=_env(tmp_path), last_action=None,
        limits=MetricLimits(file_mb=1),
    )  # fmt: skip
    assert evaluation.reward == 0.0
    assert evaluation.details["reason"] == (
        "compare_archive exceeded its 1 MiB file-size limit writing a file from the agent's result"
    )


def test_a_refused_getter_is_refused_again_by_the_evaluator(tmp_path):
    # A task stored before the review (or written to the database by other means).
    xlsx = {"func": "exact_match",
            "result": {"type": "content_from_vm_file", "path": "/home/user/a.xlsx",
                       "file_type": "xlsx", "file_content": "last_row"},
            "expected": {"type": "rule", "rules": {"expected": "x"}}}  # fmt: skip
    with pytest.raises(EnvUnavailable, match=r"result getter refused: getter "
                                             r"'content_from_vm_file' is refused: it parses"):  # fmt: skip
        evaluate_task(xlsx, env=_env(tmp_path), last_action=None)
