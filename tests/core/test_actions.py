"""The UI-TARS action grammar: real model outputs, exact errors, round trips, fuzzing, resizing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.actions import (
    ActionParseError,
    format_action,
    format_action_call,
    from_screen,
    parse_output,
    to_screen,
)
from core.imaging import QWEN25_VL
from core.protocol import SCROLL_DIRECTIONS, Action, ActionType

# ---------------------------------------------------------------------------------------------
# Outputs as UI-TARS writes them

UI_TARS_OUTPUTS = [
    (
        "Thought: I need to open the search box first.\n"
        "Action: click(start_box='<|box_start|>(235,512)<|box_end|>')",
        "I need to open the search box first.",
        Action(type=ActionType.CLICK, x=235, y=512),
    ),
    (
        "Thought: Open the file.\nAction: left_double(start_box='(10,20)')",
        "Open the file.",
        Action(type=ActionType.LEFT_DOUBLE, x=10, y=20),
    ),
    (
        "Action: right_single(start_box='[100,200,300,400]')",
        "",
        Action(type=ActionType.RIGHT_SINGLE, x=200, y=300),
    ),
    (
        "Thought: Move the slider.\nAction: drag(start_box='<|box_start|>(5,6)<|box_end|>', "
        "end_box='<|box_start|>(70,6)<|box_end|>')",
        "Move the slider.",
        Action(type=ActionType.DRAG, x=5, y=6, x2=70, y2=6),
    ),
    (
        "Thought: Copy it.\nAction: hotkey(key='ctrl c')",
        "Copy it.",
        Action(type=ActionType.HOTKEY, key="ctrl c"),
    ),
    (
        "Thought: Search.\nAction: type(content='weather in Paris\\n')",
        "Search.",
        Action(type=ActionType.TYPE, text="weather in Paris\n"),
    ),
    (
        "Thought: Quote.\nAction: type(content='It\\'s \"fine\" \\\\ ok')",
        "Quote.",
        Action(type=ActionType.TYPE, text='It\'s "fine" \\ ok'),
    ),
    (
        # UI-TARS sometimes leaves a quote unescaped; it is text unless it ends the call.
        "Thought: Name.\nAction: type(content='Bob's car')",
        "Name.",
        Action(type=ActionType.TYPE, text="Bob's car"),
    ),
    (
        'Action: type(content="double quoted")',
        "",
        Action(type=ActionType.TYPE, text="double quoted"),
    ),
    (
        "Thought: See more.\nAction: scroll(start_box='<|box_start|>(500,400)<|box_end|>', "
        "direction='down')",
        "See more.",
        Action(type=ActionType.SCROLL, x=500, y=400, direction="down"),
    ),
    ("Thought: Loading.\nAction: wait()", "Loading.", Action(type=ActionType.WAIT)),
    (
        "Thought: Done.\nAction: finished(content='The answer is 42.')",
        "Done.",
        Action(type=ActionType.FINISHED, text="The answer is 42."),
    ),
    ("Action: finished()", "", Action(type=ActionType.FINISHED)),
    ("Thought: Stuck.\nAction: call_user()", "Stuck.", Action(type=ActionType.CALL_USER)),
    (
        "Thought: A plan:\n1. click the box\n2. type\nAction: click(start_box='(1, 2)')\n",
        "A plan:\n1. click the box\n2. type",
        Action(type=ActionType.CLICK, x=1, y=2),
    ),
    (
        "Action: click(start_box=<|box_start|>(7,8)<|box_end|>)",
        "",
        Action(type=ActionType.CLICK, x=7, y=8),
    ),
    ("Action: click(point='<point>30 40</point>')", "", Action(type=ActionType.CLICK, x=30, y=40)),
]


@pytest.mark.parametrize(("text", "thought", "action"), UI_TARS_OUTPUTS)
def test_ui_tars_outputs_parse(text: str, thought: str, action: Action) -> None:
    parsed = parse_output(text)
    assert parsed.action == action
    assert parsed.thought == thought


def test_parsed_output_keeps_the_call_as_written() -> None:
    parsed = parse_output("Thought: x\nAction:   wait()  \n")
    assert parsed.action_text == "wait()"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Thought: no action here", "no 'Action:' line"),
        ("Thought: x\nAction:   ", "empty action after 'Action:'"),
        ("Action: clik(start_box='(1,2)')", "unknown action 'clik'"),
        ("Action: click()", "click needs start_box"),
        ("Action: drag(start_box='(1,2)')", "drag needs end_box"),
        ("Action: click(start_box='(a,b)')", "coordinates '(a,b)' are not integers"),
        ("Action: click(start_box='(1.5,2)')", "coordinates '(1.5,2)' are not integers"),
        (
            "Action: click(start_box='(1,2,3)')",
            "coordinates '(1,2,3)' need 2 numbers (x,y) or 4 (x1,y1,x2,y2)",
        ),
        ("Action: click(start_box='(-1,2)')", "coordinates '(-1,2)' are negative"),
        ("Action: click(start_box='(1,2)'", "missing ')' at the end of click(...)"),
        ("Action: type(content='abc", "unterminated string in argument 'content' of type"),
        ("Action: click(start_box='(1,2)', foo='x')", "click got an unexpected argument 'foo'"),
        ("Action: wait(x='1')", "wait got an unexpected argument 'x'"),
        ("Action: hotkey(key='  ')", "hotkey needs a non-empty key, e.g. key='ctrl c'"),
        (
            "Action: scroll(start_box='(1,2)', direction='sideways')",
            "scroll direction must be one of up, down, left, right, got 'sideways'",
        ),
        ("Action: scroll(direction='up')", "scroll needs start_box"),
        ("Action: click start_box", "click needs '(' after its name"),
        ("Action: (1,2)", "action '(1,2)' is not a call like click(start_box='(x,y)')"),
        ("Action: click('(1,2)')", "click arguments must be name='value', got \"'(1,2)')\""),
        ("Action: wait() wait()", "unexpected text after the action: 'wait()'"),
        (
            "Action: click(start_box='(1,2)', start_box='(3,4)')",
            "click got argument 'start_box' twice",
        ),
        ("Action: click(start_box=)", "argument 'start_box' of click has no value"),
    ],
)
def test_malformed_output_raises_an_exact_message(text: str, message: str) -> None:
    with pytest.raises(ActionParseError) as excinfo:
        parse_output(text)
    assert str(excinfo.value) == message


def test_relative1000_rejects_coordinates_past_the_far_edge() -> None:
    assert (
        parse_output("Action: click(start_box='(1000,0)')", coords="relative1000").action.x == 1000
    )
    with pytest.raises(ActionParseError, match=r"outside 0\.\.1000"):
        parse_output("Action: click(start_box='(1001,5)')", coords="relative1000")


def test_format_writes_the_canonical_ui_tars_text() -> None:
    assert (
        format_action(Action(type=ActionType.CLICK, x=3, y=4), thought="Click it.")
        == "Thought: Click it.\nAction: click(start_box='<|box_start|>(3,4)<|box_end|>')"
    )
    assert (
        format_action_call(Action(type=ActionType.TYPE, text="it's\n"))
        == "type(content='it\\'s\\n')"
    )
    assert format_action(Action(type=ActionType.WAIT)) == "Action: wait()"


def test_format_refuses_actions_that_cannot_round_trip() -> None:
    with pytest.raises(ValueError, match=r"click does not use field\(s\) \['text'\]"):
        format_action(Action(type=ActionType.CLICK, x=1, y=2, text="x"))
    with pytest.raises(ValueError, match="coordinates must be ints >= 0"):
        format_action(Action(type=ActionType.CLICK, x=-1, y=2))
    with pytest.raises(ValueError, match="line starting with 'Action:'"):
        format_action(Action(type=ActionType.WAIT), thought="plan\nAction: click")


# ---------------------------------------------------------------------------------------------
# Round trip: parse(format(a)) == a

SPECIAL = st.sampled_from(["'", '"', "\\", "\n", "\r", "\t", ")", "(", ",", "=", "\\n", "Action:"])
TEXT = st.lists(st.one_of(st.text(max_size=8), SPECIAL), max_size=8).map("".join)


def actions(max_coord: int) -> st.SearchStrategy[Action]:
    coord = st.integers(min_value=0, max_value=max_coord)
    point_types = st.sampled_from(
        [ActionType.CLICK, ActionType.LEFT_DOUBLE, ActionType.RIGHT_SINGLE]
    )
    return st.one_of(
        st.builds(Action, type=point_types, x=coord, y=coord),
        st.builds(Action, type=st.just(ActionType.DRAG), x=coord, y=coord, x2=coord, y2=coord),
        st.builds(
            Action, type=st.just(ActionType.HOTKEY), key=TEXT.filter(lambda k: k.strip() != "")
        ),
        st.builds(Action, type=st.just(ActionType.TYPE), text=TEXT),
        st.builds(
            Action,
            type=st.just(ActionType.SCROLL),
            x=coord,
            y=coord,
            direction=st.sampled_from(SCROLL_DIRECTIONS),
        ),
        st.builds(Action, type=st.just(ActionType.FINISHED), text=st.none() | TEXT),
        st.builds(Action, type=st.sampled_from([ActionType.WAIT, ActionType.CALL_USER])),
    )


THOUGHTS = TEXT.filter(lambda t: "\nAction:" not in t and "\n Action:" not in t)


@pytest.mark.slow  # 1,000 hypothesis examples: 8-16 s
@settings(max_examples=1000, deadline=None)
@given(action=actions(max_coord=4000), thought=THOUGHTS)
def test_format_then_parse_round_trips_in_pixel_space(action: Action, thought: str) -> None:
    try:
        text = format_action(action, thought=thought)
    except ValueError as error:  # only a thought with an Action: line may be refused
        assert "line starting with 'Action:'" in str(error)
        return
    parsed = parse_output(text)
    assert parsed.action == action
    assert parsed.thought == thought.strip()


@settings(max_examples=300, deadline=None)
@given(action=actions(max_coord=999))
def test_format_then_parse_round_trips_in_relative1000_space(action: Action) -> None:
    text = format_action(action, coords="relative1000")
    assert parse_output(text, coords="relative1000").action == action


# ---------------------------------------------------------------------------------------------
# Fuzz: nothing but ActionParseError, ever

FRAGMENTS = [
    "Thought: ",
    "Action: ",
    "Action:",
    "\n",
    "click(",
    "drag(",
    "type(",
    "scroll(",
    "hotkey(",
    "finished(",
    "wait(",
    "call_user(",
    "clik(",
    "start_box=",
    "end_box=",
    "content=",
    "direction=",
    "key=",
    "point=",
    "'",
    '"',
    "\\",
    "\\'",
    "<|box_start|>",
    "<|box_end|>",
    "<point>",
    "(12,",
    "34)",
    "[1,2,3,4]",
    "(a,b)",
    "-5",
    "9" * 12,
    "1000",
    ", ",
    ")",
    "(",
    "]",
    "down",
    "sideways",
    "ctrl c",
    " ",
]


def _near_miss(codes: bytes) -> str:
    """Bytes below len(FRAGMENTS) pick a fragment, the rest are latin-1 characters."""
    return "".join(FRAGMENTS[c] if c < len(FRAGMENTS) else chr(c) for c in codes)


# Drawn as bytes: list-of-fragments strategies cost twice the generation time for 10k examples.
NEAR_MISSES = st.binary(max_size=16).map(_near_miss)


@pytest.mark.slow  # thousands of hypothesis examples: 25-50 s
@settings(
    max_examples=10_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(text=st.text() | NEAR_MISSES, coords=st.sampled_from(["pixel", "relative1000"]))
def test_arbitrary_text_raises_nothing_but_action_parse_error(text: str, coords: str) -> None:
    try:
        parsed = parse_output(text, coords=coords)
    except ActionParseError:
        return
    # Whatever parses has a canonical form that parses back to the same action.
    again = parse_output(
        format_action(parsed.action, thought=parsed.thought, coords=coords), coords=coords
    )
    assert again.action == parsed.action
    assert again.thought == parsed.thought
    to_screen(parsed.action, model_size=(1932, 1092), screen_size=(1920, 1080), coords=coords)


# ---------------------------------------------------------------------------------------------
# coordinate mapping


@pytest.mark.parametrize(
    ("model_xy", "screen_xy"),
    [
        ((0, 0), (0, 0)),
        ((966, 546), (960, 540)),  # centre
        ((1932, 1092), (1919, 1079)),  # far corner clamps onto the last pixel
        ((1931, 1091), (1919, 1079)),
        ((9999, 5), (1919, 5)),  # beyond the model image: clamped
    ],
)
def test_to_screen_maps_pixel_coordinates(
    model_xy: tuple[int, int], screen_xy: tuple[int, int]
) -> None:
    action = Action(type=ActionType.CLICK, x=model_xy[0], y=model_xy[1])
    mapped = to_screen(action, model_size=(1932, 1092), screen_size=(1920, 1080))
    assert (mapped.x, mapped.y) == screen_xy


def test_to_screen_maps_relative1000_coordinates_and_both_drag_points() -> None:
    drag = Action(type=ActionType.DRAG, x=500, y=500, x2=1000, y2=0)
    mapped = to_screen(drag, screen_size=(1920, 1080), coords="relative1000")
    assert mapped == Action(type=ActionType.DRAG, x=960, y=540, x2=1919, y2=0)


def test_to_screen_scales_the_miniwob_model_image_back() -> None:
    # MiniWoB 160x210 screen, 168x224 model image.
    mapped = to_screen(
        Action(type=ActionType.SCROLL, x=84, y=112, direction="up"),
        model_size=(168, 224),
        screen_size=(160, 210),
    )
    assert mapped == Action(type=ActionType.SCROLL, x=80, y=105, direction="up")


def test_to_screen_leaves_actions_without_points_alone() -> None:
    action = Action(type=ActionType.TYPE, text="hi\n")
    assert to_screen(action, model_size=(10, 10), screen_size=(20, 20)) == action


def test_to_screen_needs_the_model_size_for_pixel_coordinates() -> None:
    with pytest.raises(ValueError, match="pixel coordinates need model_size"):
        to_screen(Action(type=ActionType.CLICK, x=1, y=1), screen_size=(10, 10))


@settings(max_examples=300, deadline=None)
@given(
    screen=st.tuples(st.integers(20, 3000), st.integers(20, 3000)),
    point=st.tuples(st.floats(0, 1, exclude_max=True), st.floats(0, 1, exclude_max=True)),
)
def test_from_screen_then_to_screen_lands_within_one_model_pixel(
    screen: tuple[int, int], point: tuple[float, float]
) -> None:
    if max(screen) / min(screen) > 200:
        return
    model = QWEN25_VL.model_size(width=screen[0], height=screen[1])
    x, y = int(point[0] * screen[0]), int(point[1] * screen[1])
    action = Action(type=ActionType.CLICK, x=x, y=y)
    back = to_screen(
        from_screen(action, model_size=model, screen_size=screen),
        model_size=model,
        screen_size=screen,
    )
    assert abs(back.x - x) <= screen[0] / model[0] + 1
    assert abs(back.y - y) <= screen[1] / model[1] + 1


def test_untypable_characters_are_named_and_every_script_is_typable():
    from core.protocol import untypable_character

    for text in ["café", "日本語", "👍", "tab\tand\nnewline", "Ωμέγα", ""]:
        assert untypable_character(text) == ""
    assert untypable_character("ding\x07") == "U+0007 (BEL)"
    assert untypable_character("a\x1b[2J") == "U+001B (ESCAPE)"
    assert untypable_character("line\u2028sep") == "U+2028 (LINE SEPARATOR)"
