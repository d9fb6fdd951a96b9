"""An OSWorld task's setup steps read only files from the task's own directory: checked and
stored at import, written into the env's private cache at reset, never read from a host
path (`envmanager.osworld_task_files`)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from datamanager.task_import import InvalidTaskRecord, parse_task_record, read_task_path
from envmanager.osworld_task_files import steps_with_task_files


def task(config: list[dict], task_id: str = "upload") -> dict:
    return {
        "id": task_id,
        "instruction": "Open the report.",
        "config": config,
        "evaluator": {"func": "infeasible"},
    }


def upload(local_path: str) -> dict:
    return {"type": "upload_file",
            "parameters": {"files": [{"local_path": local_path, "path": "/root/report.txt"}]}}  # fmt: skip


def write_task(directory: Path, data: dict, name: str = "task.json") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(json.dumps(data))
    return directory


def test_a_file_in_the_tasks_directory_travels_with_the_task_and_is_read_from_the_cache(tmp_path):
    directory = write_task(tmp_path / "tasks", task([upload("files/report.txt")]))
    (directory / "files").mkdir()
    (directory / "files" / "report.txt").write_text("quarterly numbers\n")
    (record,) = read_task_path(directory)
    assert (
        base64.b64decode(record.env_config["files"]["files/report.txt"]) == b"quarterly numbers\n"
    )
    cache = tmp_path / "cache"
    steps = steps_with_task_files(record.env_config["osworld"]["config"],
                                  record.env_config["files"], cache)  # fmt: skip
    local = Path(steps[0]["parameters"]["files"][0]["local_path"])
    assert local == cache / "files" / "report.txt" and local.read_text() == "quarterly numbers\n"
    assert local.stat().st_mode & 0o077 == 0
    # The stored record imports again as it is (an exported task carries its files).
    again = parse_task_record(
        {"name": record.name, "env_kind": "osworld", "env_config": record.env_config}, "export"
    )
    assert again.env_config == record.env_config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            [upload("/root/.ssh/id_rsa")],
            r"config\[0\].parameters.files\[0\].local_path: reads "
            r"'/root/.ssh/id_rsa' from the host: a setup step may read only a file in its task's",
        ),
        ([upload("../secret_key")], r"reads '../secret_key' from the host"),
        ([upload("missing.txt")], r"reads 'missing.txt', which is not a file in the task's"),
        ([upload("link.txt")], r"reads 'link.txt', which leads out of the task's directory"),
        (
            [{"type": "login", "parameters": {"settings_file": "/etc/shadow"}}],
            r"config\[0\].parameters.settings_file: reads '/etc/shadow' from the host",
        ),
    ],
)
def test_a_setup_step_reading_a_host_file_is_refused_at_import_with_the_step_named(
    tmp_path, config, message
):
    directory = write_task(tmp_path / "tasks", task(config))
    (directory / "link.txt").symlink_to("/etc/hostname")
    with pytest.raises(InvalidTaskRecord, match=message):
        read_task_path(directory)


def test_a_google_account_step_imports_needing_an_account_and_carries_no_host_file(tmp_path):
    # googledrive's default settings file is a path relative to the worker's directory: an
    # operator's Google account, not a file of the task. The task imports, needing one,
    # carries nothing, and a reset that reached the step would refuse it.
    directory = write_task(tmp_path / "tasks", task([{"type": "googledrive", "parameters": {}}]))
    (record,) = read_task_path(directory)
    assert "google_drive" in record.env_config["needs"]
    assert "files" not in record.env_config
    with pytest.raises(ValueError, match=r"settings_file reads 'evaluation_examples/settings/"):
        steps_with_task_files(record.env_config["osworld"]["config"], {}, tmp_path)


def test_a_task_without_its_directory_or_its_files_is_refused(tmp_path):
    record = {"name": "osworld/x", "env_kind": "osworld",
              "env_config": {"osworld": task([upload("files/report.txt")])}}  # fmt: skip
    with pytest.raises(InvalidTaskRecord, match="import the task from its directory"):
        parse_task_record(record, "tasks.jsonl line 1")
    # A task stored before its files were carried is refused at reset, naming the step.
    with pytest.raises(ValueError, match=r"config\[0\].parameters.files\[0\].local_path reads "
                                         r"'files/report.txt', which the task does not carry"):  # fmt: skip
        steps_with_task_files(task([upload("files/report.txt")])["config"], {}, tmp_path)
