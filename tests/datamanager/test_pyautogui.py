"""Reading OSWorld's and AgentNet's recorded pyautogui code into Dartboard actions, and writing
actions back: each mapping, the state one episode carries from step to step, the message of
every refusal, and that nothing in the code ever runs."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.protocol import SCROLL_DIRECTIONS, Action, ActionType
from datamanager.demos.pyautogui import (
    MAX_CODE_CHARS,
    MAX_STATEMENTS,
    PyautoguiError,
    PyautoguiReader,
    pyautogui_code,
)

FULL_HD = (1920, 1080)


def osworld() -> PyautoguiReader:
    """A reader for an OSWorld episode whose screenshots are the VM's screen size."""
    return PyautoguiReader(scale=(1.0, 1.0), screen=FULL_HD)


def agentnet() -> PyautoguiReader:
    """A reader for an AgentNet episode: fractions of a 1280x720 screenshot."""
    return PyautoguiReader(scale=(1280, 720), screen=(1280, 720))


def read(code: str) -> list[Action]:
    return osworld().actions(code)


def click(x: int, y: int, kind: ActionType = ActionType.CLICK) -> Action:
    return Action(kind, x=x, y=y)


def drag(x: int, y: int, x2: int, y2: int) -> Action:
    return Action(ActionType.DRAG, x=x, y=y, x2=x2, y2=y2)


def hotkey(key: str) -> Action:
    return Action(ActionType.HOTKEY, key=key)


def typed(text: str) -> Action:
    return Action(ActionType.TYPE, text=text)


def scroll(x: int, y: int, direction: str) -> Action:
    return Action(ActionType.SCROLL, x=x, y=y, direction=direction)


def test_an_osworld_step_clicks_at_the_cursor_types_and_presses_enter():
    code = (
        "import pyautogui\nimport time\npyautogui.moveTo(660, 1051)\npyautogui.click()\n"
        "time.sleep(0.5)\npyautogui.typewrite('hello world', interval=0.05)\n"
        "pyautogui.press('enter')"
    )
    assert read(code) == [click(660, 1051), typed("hello world"), hotkey("enter")]


@pytest.mark.parametrize(
    ("code", "kind"),
    [("WAIT", ActionType.WAIT), ("  DONE\n", ActionType.FINISHED), ("FAIL", ActionType.CALL_USER)],
)
def test_osworlds_special_words(code, kind):
    assert read(code) == [Action(kind)]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("pyautogui.click(10, 20)", click(10, 20)),
        ("pyautogui.click(x=10, y=20)", click(10, 20)),
        ("pyautogui.click((10, 20))", click(10, 20)),
        ("pyautogui.leftClick(10, 20)", click(10, 20)),
        ("pyautogui.click(10.4, 19.6, interval=0.1, duration=0.5, _pause=False)", click(10, 20)),
        ("pyautogui.click(button='primary', y=20, x=10)", click(10, 20)),
        ("pyautogui.click(10, 20, clicks=2)", click(10, 20, ActionType.LEFT_DOUBLE)),
        ("pyautogui.click(10, 20, 2)", click(10, 20, ActionType.LEFT_DOUBLE)),
        ("pyautogui.doubleClick(10, 20)", click(10, 20, ActionType.LEFT_DOUBLE)),
        ("pyautogui.double_click(x=10, y=20)", click(10, 20, ActionType.LEFT_DOUBLE)),
        ("pyautogui.click(10, 20, button='right')", click(10, 20, ActionType.RIGHT_SINGLE)),
        ("pyautogui.click(10, 20, 1, 0.0, 'right')", click(10, 20, ActionType.RIGHT_SINGLE)),
        ("pyautogui.rightClick(10, 20)", click(10, 20, ActionType.RIGHT_SINGLE)),
        ("pyautogui.right_click(x=10, y=20)", click(10, 20, ActionType.RIGHT_SINGLE)),
    ],
)
def test_clicks(code, expected):
    assert read(code) == [expected]


def test_the_cursor_carries_from_step_to_step():
    reader = osworld()
    assert reader.actions("pyautogui.moveTo(100, 200)") == []  # a hover: state, no action
    assert reader.actions("pyautogui.click()") == [click(100, 200)]
    assert reader.actions("pyautogui.moveRel(10, -20)") == []
    assert reader.actions("pyautogui.rightClick()") == [click(110, 180, ActionType.RIGHT_SINGLE)]
    assert reader.actions("pyautogui.move(xOffset=-10)\npyautogui.doubleClick()") == [
        click(100, 180, ActionType.LEFT_DOUBLE)
    ]
    # a click moves the cursor too, and a point with x alone takes y from it
    assert reader.actions("pyautogui.click(300, 400)\npyautogui.click(x=500)") == [
        click(300, 400),
        click(500, 400),
    ]


def test_a_failed_step_leaves_the_cursor_where_it_was():
    reader = osworld()
    reader.actions("pyautogui.moveTo(10, 20)")
    with pytest.raises(PyautoguiError):
        reader.actions("pyautogui.moveTo(500, 500)\npyautogui.tripleClick()")
    assert reader.actions("pyautogui.click()") == [click(10, 20)]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("pyautogui.moveTo(10, 20)\npyautogui.dragTo(300, 400, duration=0.5, button='left')",
         [drag(10, 20, 300, 400)]),
        ("pyautogui.moveTo(10, 20)\npyautogui.drag(30, -5)", [drag(10, 20, 40, 15)]),
        ("pyautogui.moveTo(10, 20)\npyautogui.dragRel(xOffset=30)", [drag(10, 20, 40, 20)]),
        ("pyautogui.mouseDown(10, 20)\npyautogui.moveTo(50, 60)\npyautogui.mouseUp()",
         [drag(10, 20, 50, 60)]),
        ("pyautogui.mouseDown([10, 20])\npyautogui.mouseUp([10, 20])", [click(10, 20)]),
        ("pyautogui.mouseDown(10, 20, button='right')\npyautogui.mouseUp(button='right')",
         [click(10, 20, ActionType.RIGHT_SINGLE)]),
    ],
)  # fmt: skip
def test_drags_and_mouse_buttons(code, expected):
    assert read(code) == expected


def test_a_mouse_button_held_across_steps_drags_when_released():
    reader = osworld()
    assert reader.actions("pyautogui.mouseDown(x=10, y=20)") == []
    assert reader.actions("pyautogui.moveTo(70, 80)") == []
    assert reader.actions("pyautogui.mouseUp(x=90, y=100)") == [drag(10, 20, 90, 100)]
    with pytest.raises(PyautoguiError, match="mouseUp without mouseDown"):
        reader.actions("pyautogui.mouseUp(x=90, y=100)")


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("pyautogui.write('hi there')", [typed("hi there")]),
        ("pyautogui.write(message='a\\nb')", [typed("a\nb")]),
        ("pyautogui.typewrite(['a', 'b', 'enter', 'C', ' ', 'tab'])",
         [typed("ab"), hotkey("enter"), typed("C "), hotkey("tab")]),
        ("pyautogui.press('Enter')", [hotkey("enter")]),
        ("pyautogui.press(' ')", [hotkey("space")]),
        ("pyautogui.press(['tab', 'tab'])", [hotkey("tab"), hotkey("tab")]),
        ("pyautogui.press('down', presses=3)", [hotkey("down")] * 3),
        ("pyautogui.press(['a', 'b'], 2)", [hotkey("a"), hotkey("b"), hotkey("a"), hotkey("b")]),
        ("pyautogui.hotkey('ctrl', 'c')", [hotkey("ctrl c")]),
        ("pyautogui.hotkey('Ctrl', 'Shift', 'T', interval=0.1)", [hotkey("ctrl shift t")]),
        ("pyautogui.hotkey(['ctrl', 'v'])", [hotkey("ctrl v")]),
        ("pyautogui.keyDown('ctrl')\npyautogui.press('c')\npyautogui.keyUp('ctrl')",
         [hotkey("ctrl c")]),
        ("pyautogui.keyDown('ctrl')\npyautogui.hotkey('ctrl', 'shift', 'z')\npyautogui.keyUp('ctrl')",
         [hotkey("ctrl shift z")]),
        ("pyautogui.keyDown('shift')\npyautogui.write('ab')\npyautogui.keyUp('shift')",
         [hotkey("shift a"), hotkey("shift b")]),
        ("pyautogui.keyDown('win')\npyautogui.keyUp('win')", [hotkey("win")]),
        ("pyautogui.keyDown('ctrl')\npyautogui.keyDown('shift')\npyautogui.keyUp('shift')\n"
         "pyautogui.keyUp('ctrl')", [hotkey("ctrl shift")]),
    ],
)  # fmt: skip
def test_keyboard(code, expected):
    assert read(code) == expected


def test_keys_held_across_steps_prefix_what_is_pressed():
    reader = osworld()
    assert reader.actions("pyautogui.keyDown('alt')") == []
    assert reader.actions("pyautogui.press('tab')") == [hotkey("alt tab")]
    assert reader.actions("pyautogui.press('tab')") == [hotkey("alt tab")]
    assert reader.actions("pyautogui.keyUp('alt')") == []
    assert reader.actions("pyautogui.press('tab')") == [hotkey("tab")]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("pyautogui.scroll(5, 100, 200)", [scroll(100, 200, "up")]),
        ("pyautogui.scroll(-3, x=100, y=200)", [scroll(100, 200, "down")]),
        ("pyautogui.vscroll(clicks=-1, x=(7, 8))", [scroll(7, 8, "down")]),
        ("pyautogui.scroll(-10)", [scroll(960, 540, "down")]),  # no cursor: the centre
        ("pyautogui.moveTo(30, 40)\npyautogui.scroll(2)", [scroll(30, 40, "up")]),
        ("pyautogui.hscroll(2)", [scroll(960, 540, "right")]),
        ("pyautogui.hscroll(-2, 5, 6)", [scroll(5, 6, "left")]),
        ("pyautogui.scroll(1, 100, 200)\npyautogui.click()", [scroll(100, 200, "up"),
                                                              click(100, 200)]),
    ],
)  # fmt: skip
def test_scrolls_keep_the_direction_only(code, expected):
    assert read(code) == expected


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("computer.wait()", Action(ActionType.WAIT)),
        ("computer.wait(seconds=3)", Action(ActionType.WAIT)),
        ("computer.terminate(status='success')", Action(ActionType.FINISHED)),
        ("computer.terminate(status='success', answer='42')",
         Action(ActionType.FINISHED, text="42")),
        ("computer.terminate(status='failure')", Action(ActionType.CALL_USER)),
    ],
)  # fmt: skip
def test_agentnets_own_calls(code, expected):
    assert agentnet().actions(code) == [expected]


def test_agentnets_fractions_scale_to_the_screenshot():
    reader = agentnet()
    assert reader.actions("pyautogui.click(x=0.5, y=0.25)") == [click(640, 180)]
    assert reader.actions("pyautogui.moveTo(x=0.1, y=0.1)") == []
    assert reader.actions("pyautogui.dragTo(x=0.9, y=0.8)") == [drag(128, 72, 1152, 576)]
    # the far edge, 1.0, is the last pixel
    assert reader.actions("pyautogui.click(x=1.0, y=1.0)") == [click(1279, 719)]
    assert reader.actions("pyautogui.moveRel(-0.5, -0.5)\npyautogui.click()") == [click(640, 360)]


def test_a_scaled_osworld_screen_maps_to_screenshot_pixels():
    reader = PyautoguiReader(scale=(0.5, 0.5), screen=(1280, 720))
    assert reader.actions("pyautogui.click(1001, 600)") == [click(500, 300)]


@pytest.mark.parametrize(
    ("code", "line", "text", "why"),
    [
        ("import pyautogui\npyautogui.tripleClick(10, 20)", 2, "pyautogui.tripleClick(10, 20)",
         "triple click has no Dartboard action"),
        ("pyautogui.click(10, 20, clicks=3)", 1, None, "triple click has no Dartboard action"),
        ("pyautogui.triple_click(10, 20)", 1, None, "triple click has no Dartboard action"),
        ("computer.triple_click(x=0.1, y=0.2)", 1, None, "triple click has no Dartboard action"),
        ("pyautogui.middleClick(10, 20)", 1, None, "middle click has no Dartboard action"),
        ("pyautogui.click(10, 20, button='middle')", 1, None, "middle click has no Dartboard action"),
        ("pyautogui.doubleClick(10, 20, button='right')", 1, None, "right double click"),
        ("pyautogui.click()", 1, None, "no cursor position is known yet"),
        ("pyautogui.moveRel(5, 5)", 1, None, "no cursor position is known yet"),
        ("pyautogui.dragTo(10, 20)", 1, None, "no cursor position is known yet"),
        ("pyautogui.moveTo(1, 2)\npyautogui.dragTo(10, 20, button='right')", 2, None,
         "a drag with the right button has no Dartboard action"),
        ("pyautogui.mouseDown(1, 2, button='right')\npyautogui.mouseUp(9, 9, button='right')", 2,
         None, "a drag with the right button has no Dartboard action"),
        ("pyautogui.mouseUp(10, 20)", 1, None, "mouseUp without mouseDown"),
        ("pyautogui.mouseDown(1, 2)\npyautogui.press('a')", 2, None, "button is held by mouseDown"),
        ("pyautogui.keyDown('ctrl')\npyautogui.click(1, 2)", 2, None, "ctrl is held by keyDown"),
        ("pyautogui.keyUp('ctrl')", 1, None, "keyUp of 'ctrl' without keyDown"),
        ("pyautogui.scroll(0, 10, 20)", 1, None, "0 clicks"),
        ("pyautogui.hscroll(0)", 1, None, "0 clicks"),
        ("computer.terminate(status='maybe')", 1, None, "status must be 'success' or 'failure'"),
        ("pyautogui.press('enter', presses=0)", 1, None, "presses=0"),
        ("pyautogui.hotkey('ctrl', '+')", 1, None, "key '+' cannot be written"),
        ("x = 10\npyautogui.click(x, 20)", 1, "x = 10", "an assignment is not a pyautogui call"),
        ("pyautogui.click(x, 20)", 1, None, "x is not a literal"),
        ("pyautogui.click(10 + 5, 20)", 1, None, "x is not a literal"),
        ("pyautogui.write(f'{1}')", 1, None, "message is not a literal"),
        ("pyautogui.hotkey('ctrl', key)", 1, None, "argument 2 is not a literal"),
        ("pyautogui.click(*[10, 20])", 1, None, "*arguments are not read"),
        ("pyautogui.click(True, 20)", 1, None, "x must be a finite number, got True"),
        ("pyautogui.click('button.png')", 1, None, "an image to locate; only points are read"),
        ("pyautogui.click(x=300)", 1, None, "a point with x or y alone takes the other"),
        ("pyautogui.click(10, 20, foo=1)", 1, None, "unknown argument 'foo'"),
        ("pyautogui.click(10, 20, x=3)", 1, None, "argument 'x' given twice"),
        ("pyautogui.keyUp('a', None, True, 4)", 1, None, "more than 3 positional arguments"),
        ("pyautogui.click(1921, 20)\n", 1, None, "outside the 1920x1080 screenshot"),
        ("pyautogui.click(5, -1)", 1, None, "outside the 1920x1080 screenshot"),
        ("pyautogui.click(1e400, 1)", 1, None, "x must be a finite number, got inf"),
        ("pyautogui.click(1e300, 1)", 1, None, "outside the 1920x1080 screenshot"),
        ("pyautogui.locateOnScreen('ok.png')", 1, None, "pyautogui.locateOnScreen() has no"),
        ("click(10, 20)", 1, None, "only calls of pyautogui.*, computer.* and time.sleep"),
        ("os.system('ls')", 1, None, "only calls of pyautogui.*, computer.* and time.sleep"),
        ("import os", 1, None, "only `import pyautogui` and `import time` are read"),
        ("import pyautogui as pg", 1, None, "only `import pyautogui` and `import time`"),
        ("from os import system", 1, None, "only imports from pyautogui and time are read"),
        ("for i in range(3):\n    pyautogui.press('tab')", 1,
         "for i in range(3):\n    pyautogui.press('tab')", "a loop is not a pyautogui call"),
        ("if True:\n    pyautogui.press('tab')", 1, "if True:\n    pyautogui.press('tab')",
         "an if is not a pyautogui call"),
        ("def f():\n    pass", 1, "def f():\n    pass", "a def is not a pyautogui call"),
        ("'click the button'", 1, None, "an expression is not a pyautogui call"),
        ("import pyautogui\n\npyautogui.click(10, 20\n", 3, "pyautogui.click(10, 20",
         "syntax error"),
    ],
)  # fmt: skip
def test_what_does_not_map_is_an_error_naming_the_line_and_the_text(code, line, text, why):
    statement = text if text is not None else code.splitlines()[line - 1]
    with pytest.raises(PyautoguiError) as raised:
        read(code)
    message = str(raised.value)
    assert message.startswith(f"line {line}: {statement!r}: "), message
    assert why in message


def test_a_long_statement_is_shortened_in_the_message():
    code = f"pyautogui.write({'x' * 500!r}, interval=foo)"
    with pytest.raises(PyautoguiError) as raised:
        read(code)
    assert str(raised.value) == f"line 1: {code[:77] + '...'!r}: interval is not a literal " + (
        "(a number, a string, or a list of them)"
    )


@pytest.mark.parametrize("code", ["", "  \n", "import pyautogui\nimport time\ntime.sleep(2)"])
def test_code_with_no_action_is_an_error(code):
    with pytest.raises(PyautoguiError, match="no pyautogui or computer action"):
        read(code)


def test_a_nul_character_in_the_code_is_an_error():
    with pytest.raises(PyautoguiError, match="null bytes") as raised:
        read("pyautogui.write('a\x00')")
    assert "line None" not in str(raised.value)


def test_steps_are_bounded():
    at_most = "\n".join(["pyautogui.press('tab')"] * MAX_STATEMENTS)
    assert len(read(at_most)) == MAX_STATEMENTS
    with pytest.raises(PyautoguiError, match=f"{MAX_STATEMENTS + 1} statements; at most"):
        read(at_most + "\npyautogui.press('tab')")
    with pytest.raises(PyautoguiError, match="at most 20,000 in one step"):
        read(f"pyautogui.write({'a' * MAX_CODE_CHARS!r})")
    with pytest.raises(PyautoguiError, match="nested too deeply"):
        read("pyautogui.click(" + "-" * 10_000 + "1, 2)")


def test_the_code_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    for code in [
        f"__import__('os').system('touch {marker}')",
        f"pyautogui.click(10, 20)\n__import__('os').system('touch {marker}')",
        f"pyautogui.write(__import__('os').system('touch {marker}'))",
        f"pyautogui.click(open({str(marker)!r}, 'w'))",
        "pyautogui.click(open('/etc/passwd'))",
    ]:
        with pytest.raises(PyautoguiError):
            read(code)
    assert not marker.exists()


def test_reading_needs_no_django():
    probe = "import sys, datamanager.demos.pyautogui; print('django' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("action", "code"),
    [
        (click(10, 20), "pyautogui.click(10, 20)"),
        (click(10, 20, ActionType.LEFT_DOUBLE), "pyautogui.doubleClick(10, 20)"),
        (click(10, 20, ActionType.RIGHT_SINGLE), "pyautogui.rightClick(10, 20)"),
        (drag(1, 2, 3, 4), "pyautogui.moveTo(1, 2)\npyautogui.dragTo(3, 4, button='left')"),
        (hotkey("ctrl c"), "pyautogui.hotkey('ctrl', 'c')"),
        (hotkey("control+Return"), "pyautogui.hotkey('ctrl', 'enter')"),
        (hotkey("enter"), "pyautogui.press('enter')"),
        (typed("it's"), 'pyautogui.write("it\'s")'),
        (scroll(5, 6, "up"), "pyautogui.scroll(5, x=5, y=6)"),
        (scroll(5, 6, "down"), "pyautogui.scroll(-5, x=5, y=6)"),
        (scroll(5, 6, "left"), "pyautogui.hscroll(-5, x=5, y=6)"),
        (scroll(5, 6, "right"), "pyautogui.hscroll(5, x=5, y=6)"),
        (Action(ActionType.WAIT), "WAIT"),
        (Action(ActionType.FINISHED, text="done it"), "DONE"),
        (Action(ActionType.CALL_USER), "FAIL"),
    ],
)
def test_writing_pyautogui_code(action, code):
    assert pyautogui_code(action) == code


BIG = (4000, 3000)
KEY_NAMES = ["ctrl", "shift", "alt", "win", "enter", "esc", "tab", "backspace", "delete",
             "space", "up", "pageup", "home", "f5", "a", "z", "7", "/", ",", "'", "\\"]  # fmt: skip
xs, ys = st.integers(0, BIG[0] - 1), st.integers(0, BIG[1] - 1)
any_action = st.one_of(
    st.builds(
        Action,
        st.sampled_from([ActionType.CLICK, ActionType.LEFT_DOUBLE, ActionType.RIGHT_SINGLE]),
        x=xs,
        y=ys,
    ),
    st.builds(Action, st.just(ActionType.DRAG), x=xs, y=ys, x2=xs, y2=ys),
    st.lists(st.sampled_from(KEY_NAMES), min_size=1, max_size=3, unique=True).map(
        lambda keys: hotkey(" ".join(keys))
    ),
    st.text().map(typed),
    st.builds(scroll, xs, ys, st.sampled_from(SCROLL_DIRECTIONS)),
    st.sampled_from([ActionType.WAIT, ActionType.FINISHED, ActionType.CALL_USER]).map(Action),
)


@pytest.mark.parametrize(
    "action",
    [
        typed("line one\nline 'two' \"three\"\\ \t café 東京 🎯\x00"),
        typed(""),
        drag(0, 0, BIG[0] - 1, BIG[1] - 1),
        hotkey("ctrl shift '"),
    ],
)
def test_written_code_reads_back_as_the_action(action):
    assert PyautoguiReader(scale=(1, 1), screen=BIG).actions(pyautogui_code(action)) == [action]


@settings(max_examples=200, deadline=None, database=None)
@given(any_action)
def test_any_action_round_trips(action):
    assert PyautoguiReader(scale=(1, 1), screen=BIG).actions(pyautogui_code(action)) == [action]
