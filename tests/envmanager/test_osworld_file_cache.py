"""The files OSWorld tasks fetch by URL come from this host's content-addressed cache: filled
from a web server (here one on 127.0.0.1) or from a copy of OSWorld's file-cache folder, put
where the wheel's own client looks first, checked against their hash, never downloaded at
run time (envmanager.osworld_file_cache)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from envmanager.osworld_evaluator import WheelEnv
from envmanager.osworld_file_cache import (
    CacheError,
    FileCache,
    copy_layout,
    place_task_files,
    task_files_by_url,
    task_urls,
    wheel_cache_name,
)
from envmanager.osworld_wheel import wheel

FILES = {"/calc/report.xlsx": b"the task's spreadsheet", "/calc/gold.xlsx": b"the gold file"}


class _Files(BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self) -> None:
        _Files.requests.append(self.path)
        body = FILES.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def file_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    _Files.requests = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def osworld_task(base: str) -> dict:
    return {
        "id": "calc-report",
        "instruction": "Sum the column.",
        "config": [
            {
                "type": "download",
                "parameters": {
                    "files": [{"url": f"{base}/calc/report.xlsx", "path": "/home/user/r.xlsx"}]
                },
            }
        ],
        "evaluator": {
            "func": "compare_table",
            "result": {"type": "vm_file", "path": "/home/user/r.xlsx", "dest": "r.xlsx"},
            "expected": {"type": "cloud_file", "path": f"{base}/calc/gold.xlsx", "dest": "g.xlsx"},
        },
    }


def test_fetched_files_are_served_where_the_wheels_client_looks_and_nothing_is_downloaded(
    tmp_path, file_server
):
    spec = osworld_task(file_server)
    cache = FileCache(tmp_path / "cache")
    assert cache.missing(task_urls(spec)) == task_urls(spec)
    for url in task_urls(spec):
        cache.fetch(url)
    assert cache.missing(task_urls(spec)) == []
    fetched = len(_Files.requests)
    into = tmp_path / "env-cache"
    into.mkdir()
    place_task_files(spec, cache, into)
    download, _ = task_files_by_url(spec)
    assert (into / wheel_cache_name(download)).read_bytes() == FILES["/calc/report.xlsx"]
    # The wheel's own cloud_file getter finds the gold file and downloads nothing.
    env = WheelEnv("127.0.0.1", 9, None, None, cache_dir=str(into))
    gold = wheel().getters["cloud_file"](env, spec["evaluator"]["expected"])
    assert Path(gold).read_bytes() == FILES["/calc/gold.xlsx"]
    assert len(_Files.requests) == fetched  # the server saw no request after the fetch


def test_a_url_the_cache_lacks_is_named_and_nothing_is_placed(tmp_path, file_server):
    spec = osworld_task(file_server)
    cache = FileCache(tmp_path / "cache")
    cache.fetch(f"{file_server}/calc/report.xlsx")
    into = tmp_path / "env-cache"
    into.mkdir()
    with pytest.raises(CacheError, match=rf"1 file\(s\) of this task are not in the file cache .*"
                                         rf"{file_server}/calc/gold.xlsx"):  # fmt: skip
        place_task_files(spec, cache, into)
    assert list(into.iterdir()) == []
    with pytest.raises(CacheError, match=r"/calc/missing.bin: 404"):
        cache.fetch(f"{file_server}/calc/missing.bin")


def test_a_cached_file_changed_on_disk_is_refused_and_never_served(tmp_path, file_server):
    cache = FileCache(tmp_path / "cache")
    entry = cache.fetch(f"{file_server}/calc/gold.xlsx")
    stored = tmp_path / "cache" / "objects" / entry.sha256[:2] / entry.sha256
    stored.write_bytes(b"the agent's own spreadsheet")
    target = tmp_path / "gold.xlsx"
    with pytest.raises(CacheError, match="does not match its hash"):
        cache.copy_to(entry.url, target)
    assert not target.exists()


def test_a_copy_of_osworlds_file_cache_folder_fills_the_cache(tmp_path):
    hub = "https://huggingface.co/datasets/xlangai/ubuntu_osworld_file_cache/resolve/main"
    spec = osworld_task("https://drive.example.com")
    spec["config"][0]["parameters"]["files"][0]["url"] = (
        f"{hub}/libreoffice_calc/calc-report/r.xlsx"
    )
    folder = tmp_path / "ubuntu_osworld_file_cache"
    (folder / "libreoffice_calc" / "calc-report").mkdir(parents=True)
    (folder / "libreoffice_calc" / "calc-report" / "r.xlsx").write_bytes(b"from the hub")
    # A URL of another host is found by the task's id and the file's name in the task.
    (folder / "libreoffice_calc" / "calc-report" / "g.xlsx").write_bytes(b"gold")
    cache = FileCache(tmp_path / "cache")
    added, lacking = copy_layout(cache, folder, spec)
    assert (len(added), lacking) == (2, [])
    assert cache.missing(task_urls(spec)) == []
    (folder / "libreoffice_calc" / "calc-report" / "g.xlsx").unlink()
    added, lacking = copy_layout(FileCache(tmp_path / "other"), folder, spec)
    assert lacking == ["https://drive.example.com/calc/gold.xlsx"]
