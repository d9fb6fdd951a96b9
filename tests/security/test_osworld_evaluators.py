"""OSWorld evaluators run in the env worker, outside the sandbox: a metric that would import,
run or write what the agent (or the task) supplies is refused at task import, with its name
and why, and again by the evaluator; so is a getter whose cache file name is a path.

The evaluator calls here use the wheel's own `cache_file` getter (it reads a file of the
evaluator's cache directory), so the metric under test gets real files and no desktop is
needed: the test file below is what an agent could have written, and before the refusal
the wheel's check_python_file_by_test_suite imported and ran it in this process.
"""

from __future__ import annotations

import inspect
import json
import re
import sys

import pytest

from core.protocol import EnvUnavailable
from datamanager.task_import import InvalidTaskRecord, read_task_file
from envmanager.osworld_evaluator import WheelEnv, evaluate_task
from envmanager.osworld_wheel import REFUSED_METRICS, SAFE_METRICS, wheel

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


def test_every_metric_of_the_loaded_modules_was_read_and_the_safe_ones_run_no_code():
    w = wheel()
    defined = set(w.metrics) | set(w.refused_metrics)
    assert set(w.metrics) == SAFE_METRICS  # every safe name exists, and only those run
    assert set(REFUSED_METRICS) <= set(w.refused_metrics)
    assert defined == SAFE_METRICS | set(REFUSED_METRICS)  # nothing defined went unread
    for name, fn in w.metrics.items():
        assert not RUNS_CODE.search(inspect.getsource(fn)), name
    vscode = sys.modules["desktop_env.evaluators.metrics.vscode"]
    assert RUNS_CODE.search(inspect.getsource(getattr(vscode, EXEC_METRIC)))  # the scan sees
