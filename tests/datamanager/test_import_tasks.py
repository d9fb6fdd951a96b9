"""`manage.py import_tasks`: all-or-nothing per file, names the bad line, idempotent."""

import json

import pytest
from django.core.management import CommandError, call_command

from datamanager.models import Task

pytestmark = pytest.mark.django_db


def _write(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


GOOD = [
    {
        "name": "miniwob/click-test",
        "env_kind": "miniwob",
        "env_config": {"task": "click-test"},
        "split": "train",
        "tags": ["click", "easy"],
    },
    {
        "name": "desktop/save-note",
        "env_kind": "desktop",
        "instruction": "Save a note",
        "split": "eval",
    },
]


def test_import_creates_tasks_and_is_idempotent(tmp_path, capsys):
    path = _write(tmp_path / "tasks.jsonl", ["# comment", "", *GOOD])
    call_command("import_tasks", str(path))
    call_command("import_tasks", str(path))
    assert Task.objects.count() == 2
    t = Task.objects.get(name="miniwob/click-test")
    assert t.tags == ["click", "easy"] and t.env_config == {"task": "click-test"}
    assert Task.objects.get(name="desktop/save-note").split == "eval"
    assert "0 tasks created, 2 updated" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"name": "x", "env_kind": "miniwob"', "line 3: invalid JSON"),
        (
            {"name": "x", "env_kind": "android"},
            "line 3: field 'env_kind' must be one of miniwob, desktop",
        ),
        ({"name": "", "env_kind": "miniwob"}, "line 3: field 'name' must be a non-empty string"),
        (
            {"name": "x", "env_kind": "miniwob", "split": "test"},
            "line 3: field 'split' must be train or eval",
        ),
        (
            {"name": "x", "env_kind": "miniwob", "tags": "a,b"},
            "line 3: field 'tags' must be a list",
        ),
        ({"name": "x", "env_kind": "miniwob", "colour": 1}, "line 3: unknown field 'colour'"),
    ],
)
def test_one_bad_line_writes_nothing_and_names_the_line(tmp_path, bad, message):
    path = _write(tmp_path / "tasks.jsonl", [*GOOD, bad])
    with pytest.raises(CommandError) as err:
        call_command("import_tasks", str(path))
    assert message in str(err.value)
    assert "nothing was imported" in str(err.value)
    assert Task.objects.count() == 0


def test_json_array_file_names_the_record(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([GOOD[0], {"env_kind": "miniwob"}]))
    with pytest.raises(CommandError, match="record 2: field 'name'"):
        call_command("import_tasks", str(path))
    assert not Task.objects.exists()


def test_duplicate_names_in_one_file_are_rejected(tmp_path):
    path = _write(tmp_path / "tasks.jsonl", [GOOD[0], GOOD[0]])
    with pytest.raises(CommandError, match="appears twice"):
        call_command("import_tasks", str(path))


def _osworld(**changes):
    task = {
        "id": "demo-task",
        "instruction": "Create ~/done.txt",
        "config": [{"type": "execute", "parameters": {"command": ["true"]}}],
        "related_apps": ["terminal"],
        "evaluator": {
            "func": "exact_match",
            "result": {"type": "vm_command_line", "command": ["cat", "/home/user/done.txt"]},
            "expected": {"type": "rule", "rules": {"expected": "ok\n"}},
        },
    }
    return task | changes


def test_osworld_task_files_and_directories_import_as_osworld_tasks(tmp_path, capsys):
    call_command("import_tasks", "tasks/osworld")
    tasks = Task.objects.filter(env_kind="osworld")
    assert tasks.count() == 12
    mkdir = tasks.get(name="osworld/dartboard-terminal-mkdir")
    assert mkdir.env_config["osworld"]["evaluator"]["func"] == "exact_match"
    assert mkdir.instruction == "Create a folder named projects in your home folder."
    assert mkdir.tags == ["osworld", "terminal"]
    single = tmp_path / "demo-task.json"
    single.write_text(json.dumps(_osworld()))
    call_command("import_tasks", str(single))
    assert Task.objects.get(name="osworld/demo-task").env_config["osworld"] == _osworld()


def test_what_dartboard_cannot_run_is_named_by_file_and_field_and_nothing_is_written(tmp_path):
    good = tmp_path / "a-good.json"
    good.write_text(json.dumps(_osworld(id="fine")))
    bad = tmp_path / "b-bad.json"
    bad.write_text(
        json.dumps(
            _osworld(
                config=[
                    {"type": "execute", "parameters": {}},
                    {"type": "teleport", "parameters": {}},
                ],
                evaluator={
                    "func": ["exact_match", "compare_tables"],
                    "result": [{"type": "vm_file"}, {"type": "chrome_tabs"}],
                    "expected": [{"type": "rule"}, {"type": "rule"}],
                },
            )
        )
    )
    worse = tmp_path / "c-worse.json"
    worse.write_text(json.dumps(_osworld(id="worse", evaluator={"func": "exact_matches"})))
    with pytest.raises(CommandError) as err:
        call_command("import_tasks", str(tmp_path))
    message = str(err.value)
    assert message.startswith(f"2 of 3 files in {tmp_path} cannot be imported:\n")
    assert f"{bad}: config[1].type: unknown setup step type 'teleport'" in message
    # A name the wheel lacks is refused with the names nearest to it.
    assert (
        f"{bad}: evaluator.func[1]: the wheel has no metric 'compare_tables' (closest: " in message
    )
    assert "compare_table, " in message
    assert f"{bad}: evaluator.result[1].type: the wheel has no getter 'chrome_tabs'" in message
    # Every bad file of the directory is listed, not only the first.
    assert (
        f"\n{worse}: evaluator.func: the wheel has no metric 'exact_matches' (closest: exact_match"
        in message
    )
    assert "nothing was imported" in message
    assert not Task.objects.exists()  # not even the good file of the directory


def test_an_infeasible_osworld_task_needs_no_getter(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_osworld(evaluator={"func": "infeasible"})))
    call_command("import_tasks", str(path))
    assert Task.objects.get(name="osworld/demo-task").env_kind == "osworld"
