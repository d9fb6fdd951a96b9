"""Dartboard actions as OSWorld's pyautogui code: one call per action, coordinates scaled to
the VM's screen, text passed through repr (never spliced), keys checked against OSWorld's
KEYBOARD_KEYS; and the wheel is imported without its heavy package __init__s."""

from __future__ import annotations

import ast
import sys

import pytest

from core.protocol import Action, ActionNotSupported, ActionType
from envmanager.osworld_actions import pyautogui_command
from envmanager.osworld_wheel import exported_names, wheel


def code(action: Action, scale=(1.0, 1.0)) -> str | None:
    # The wheel is read at the first test (cached), not at every xdist worker's collection.
    return pyautogui_command(action, scale=scale, keys=wheel().keyboard_keys)


def test_points_are_scaled_to_the_vms_screen():
    # A 1920x1080 VM whose screenshots arrive at 960x540: every point doubles.
    assert (
        code(Action(type=ActionType.CLICK, x=100, y=50), (2.0, 2.0)) == "pyautogui.click(200, 100)"
    )
    assert code(Action(type=ActionType.LEFT_DOUBLE, x=3, y=4)) == "pyautogui.doubleClick(3, 4)"
    assert code(Action(type=ActionType.RIGHT_SINGLE, x=3, y=4)) == "pyautogui.rightClick(3, 4)"
    drag = code(Action(type=ActionType.DRAG, x=10, y=10, x2=30, y2=40), (1.5, 1.5))
    assert drag.startswith("pyautogui.moveTo(15, 15); pyautogui.dragTo(45, 60,")
    scroll = code(Action(type=ActionType.SCROLL, x=5, y=5, direction="down"))
    assert scroll == "pyautogui.moveTo(5, 5); pyautogui.scroll(-5)"


def test_text_is_one_literal_whatever_it_contains():
    nasty = "'); import os; os.system('id'); ('\n\"\\"
    call = code(Action(type=ActionType.TYPE, text=nasty))
    tree = ast.parse(call)
    assert len(tree.body) == 1  # one statement: the typewrite call
    assert ast.literal_eval(tree.body[0].value.args[0]) == nasty
    with pytest.raises(ActionNotSupported, match="at most 1000"):
        code(Action(type=ActionType.TYPE, text="x" * 1001))


def test_text_beyond_ascii_is_one_literal_in_a_fixed_snippet():
    nasty = "café'); import os; os.system('id'); ('\n\"\\ 日本"
    snippet = code(Action(type=ActionType.TYPE, text=nasty))
    prefix = "import pyautogui; import time; pyautogui.FAILSAFE = False; "  # OSWorld's
    tree = ast.parse(prefix + snippet)
    strings = [
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]
    assert nasty in strings  # the text, whole, as data
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not any("system" in c or "exec" in c or "eval" in c for c in calls)
    assert code(Action(type=ActionType.TYPE, text=nasty)) == snippet  # fixed: no randomness
    with pytest.raises(ActionNotSupported, match=r"U\+0007 \(BEL\)"):
        code(Action(type=ActionType.TYPE, text="bell\x07"))


def test_keys_map_to_pyautogui_names_or_are_refused():
    assert code(Action(type=ActionType.HOTKEY, key="ctrl s")) == "pyautogui.hotkey('ctrl', 's')"
    assert code(Action(type=ActionType.HOTKEY, key="Control+Return")) == (
        "pyautogui.hotkey('ctrl', 'enter')"
    )
    with pytest.raises(ActionNotSupported, match="no key 'hyper'"):
        code(Action(type=ActionType.HOTKEY, key="hyper x"))


def test_ending_and_waiting_run_nothing_in_the_vm():
    for kind in (ActionType.WAIT, ActionType.FINISHED, ActionType.CALL_USER):
        assert code(Action(type=kind)) is None


def test_the_wheel_loads_every_module_its_packages_export_and_never_its_vm():
    w = wheel()
    for package in ("metrics", "getters"):
        modules = set(exported_names(f"desktop_env.evaluators.{package}").values())
        for module in modules:
            assert f"desktop_env.evaluators.{package}.{module}" in sys.modules, module
    assert "desktop_env.desktop_env" not in sys.modules  # the class that boots a VM
    assert {"compare_table", "compare_pptx_files", "compare_docx_files"} <= set(w.metrics)
    assert {"vm_file", "cloud_file", "vlc_config", "active_tab_info"} <= set(w.getters)
