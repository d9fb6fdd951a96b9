"""OSWorld tasks import with what they need and the files they fetch: a run whose tasks no
slot of it can host is refused at create, naming the tasks and what they lack; the file
cache is filled by `osworld_cache`; splits are set at import or from a split file; the
coverage command counts a directory's tasks per domain."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from datamanager.config import ConfigInvalid
from datamanager.models import Task
from datamanager.services.runs import run_config_validate
from envmanager.osworld_needs import OSWORLD_VM_OFFERS

pytestmark = pytest.mark.django_db


class _Files(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path.startswith("/files/") else 404)
        self.end_headers()
        self.wfile.write(f"bytes of {self.path}".encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def file_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def file_cache(settings, tmp_path) -> Path:
    settings.OSWORLD_FILE_CACHE = tmp_path / "osworld-files"
    return settings.OSWORLD_FILE_CACHE


def chrome_task(task_id: str, url: str) -> dict:
    """A task that opens a public site in Chrome and reads the active tab's URL: it needs
    Chrome, its debugging port, the accessibility tree and the internet."""
    return {
        "id": task_id,
        "instruction": "Open the airline's site.",
        "config": [
            {
                "type": "launch",
                "parameters": {"command": ["google-chrome", "--remote-debugging-port=1337"]},
            },
            {"type": "chrome_open_tabs", "parameters": {"urls_to_open": [url]}},
        ],
        "related_apps": ["chrome"],
        "evaluator": {
            "func": "is_expected_url_pattern_match",
            "result": {"type": "active_url_from_accessTree", "goto_prefix": "https://www."},
            "expected": {"type": "rule", "rules": {"expected": ["airline"]}},
        },
    }  # fmt: skip  (the launch step on one line, as OSWorld writes it)


def calc_task(task_id: str, base: str) -> dict:
    """A spreadsheet task whose input and gold file are fetched by URL."""
    return {
        "id": task_id,
        "instruction": "Sum column B.",
        "config": [
            {
                "type": "download",
                "parameters": {
                    "files": [{"url": f"{base}/files/{task_id}.xlsx", "path": "/home/user/t.xlsx"}]
                },
            },
            {"type": "open", "parameters": {"path": "/home/user/t.xlsx"}},
        ],
        "related_apps": ["libreoffice_calc"],
        "evaluator": {
            "func": "compare_table",
            "result": {"type": "vm_file", "path": "/home/user/t.xlsx", "dest": "t.xlsx"},
            "expected": {
                "type": "cloud_file",
                "path": f"{base}/files/{task_id}-gold.xlsx",
                "dest": "gold.xlsx",
            },
            "options": {"rules": [{"type": "sheet_data", "sheet_idx0": 0, "sheet_idx1": "EI0"}]},
        },
    }  # fmt: skip  (nested as OSWorld writes it)


def write(directory: Path, domain: str, spec: dict) -> Path:
    (directory / domain).mkdir(parents=True, exist_ok=True)
    path = directory / domain / f"{spec['id']}.json"
    path.write_text(json.dumps(spec))
    return path


def osworld_run(**env) -> dict:
    return {"tasks": {"env_kinds": ["osworld"]},
            "env": {"miniwob_slots": 0, "osworld_addresses": ["127.0.0.1:5000"], **env}}  # fmt: skip


def test_a_task_imports_with_its_needs_and_a_run_without_them_is_refused_naming_them(
    tmp_path, file_cache, file_server, capsys
):
    examples = tmp_path / "examples"
    write(examples, "chrome", chrome_task("fly", "https://www.airline.example/"))
    write(examples, "libreoffice_calc", calc_task("sum", file_server))
    call_command("import_tasks", str(examples))
    assert "1 of these OSWorld tasks fetch files the file cache" in capsys.readouterr().out
    needs = Task.objects.get(name="osworld/fly").env_config["needs"]
    assert needs == ["accessibility_tree", "app:chrome", "chrome_cdp", "internet"]
    assert Task.objects.get(name="osworld/sum").env_config["needs"] == ["app:libreoffice"]

    with pytest.raises(ConfigInvalid) as refused:
        run_config_validate(data=osworld_run(), user=None)
    found = {p.path: p.message for p in refused.value.problems}
    assert found["env.osworld_offers"].startswith(
        "1 OSWorld task(s) need what the run's VMs do not offer: osworld/fly needs internet"
    )
    assert found["tasks"].startswith(
        f"1 OSWorld task(s) fetch files the file cache ({file_cache}) lacks: osworld/sum: "
        f"{file_server}/files/sum.xlsx, {file_server}/files/sum-gold.xlsx"
    )

    call_command("osworld_cache", "fetch")
    assert "2 fetched, 0 already cached, 0 failed" in capsys.readouterr().out
    offers = [*OSWORLD_VM_OFFERS, "internet"]
    config = run_config_validate(data=osworld_run(osworld_offers=offers), user=None)
    assert "internet" in config.env.osworld_offers


def test_fetch_names_what_failed_and_status_lists_what_is_missing(
    tmp_path, file_cache, file_server, capsys
):
    spec = calc_task("sum", file_server)
    spec["evaluator"]["expected"]["path"] = f"{file_server}/elsewhere/gold.xlsx"
    path = write(tmp_path / "examples", "libreoffice_calc", spec)
    with pytest.raises(CommandError, match=rf"{file_server}/elsewhere/gold.xlsx: 404"):
        call_command("osworld_cache", "fetch", str(path))
    call_command("osworld_cache", "status", str(path))
    out = capsys.readouterr().out
    assert "1 of 2 files of 1 tasks cached" in out
    assert f"missing: {file_server}/elsewhere/gold.xlsx" in out


def test_splits_at_import_and_from_a_split_file(tmp_path):
    examples = tmp_path / "examples"
    for task_id in ("a", "b", "c"):
        write(examples, "chrome", chrome_task(task_id, "http://localhost/"))
    call_command("import_tasks", str(examples), "--split", "eval")
    assert set(Task.objects.values_list("split", flat=True)) == {"eval"}
    # DART's and OSWorld's lists: {domain: [task ids]}; an id names osworld/<id>.
    listing = tmp_path / "train.json"
    listing.write_text(json.dumps({"chrome": ["a", "b"]}))
    call_command("set_split", str(listing), "--split", "train", "--others", "eval")
    assert dict(Task.objects.values_list("name", "split")) == {
        "osworld/a": "train", "osworld/b": "train", "osworld/c": "eval"}  # fmt: skip
    listing.write_text("osworld/c\n# a comment\nnot-a-task\n")
    with pytest.raises(
        CommandError, match=r"1 listed task\(s\) match no task: not-a-task; nothing"
    ):
        call_command("set_split", str(listing), "--split", "train")
    assert Task.objects.get(name="osworld/c").split == "eval"


def test_coverage_counts_per_domain_what_imports_and_what_can_run(
    tmp_path, file_cache, file_server, capsys
):
    examples = tmp_path / "examples"
    write(examples, "chrome", chrome_task("fly", "https://www.airline.example/"))
    write(examples, "chrome", chrome_task("local", "http://localhost:8000/"))
    write(examples, "libreoffice_calc", calc_task("sum", file_server))
    broken = calc_task("broken", file_server)
    broken["evaluator"]["func"] = "compare_tables"
    write(examples, "libreoffice_calc", broken)
    listing = tmp_path / "test_all.json"
    listing.write_text(
        json.dumps({"chrome": ["fly", "local"], "libreoffice_calc": ["sum", "broken"]})
    )
    call_command("osworld_coverage", str(examples), "--list", str(listing))
    out = capsys.readouterr().out
    assert "chrome                      2       2        1         1" in out
    assert "libreoffice_calc            2       1        1         0" in out
    assert "total                       4       3        2         1" in out
    assert "evaluator.func: the wheel has no metric 'compare_tables' (closest: compare_table" in out
    assert "     1  internet" in out
    assert "fetching files the file cache lacks: 1 tasks" in out
    assert not Task.objects.exists()  # the count writes nothing
