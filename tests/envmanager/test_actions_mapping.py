"""Every UI-TARS action type maps to a real browser/X action or raises ActionNotSupported."""

from __future__ import annotations

import pytest

from core.protocol import Action, ActionNotSupported, ActionType, TaskSpec
from envmanager.desktop_env import DesktopEnv
from envmanager.miniwob_env import MiniWoBEnv
from envmanager.threaded import ThreadedEnv

EVERY_ACTION = {
    ActionType.CLICK: Action(type=ActionType.CLICK, x=20, y=100),
    ActionType.LEFT_DOUBLE: Action(type=ActionType.LEFT_DOUBLE, x=20, y=100),
    ActionType.RIGHT_SINGLE: Action(type=ActionType.RIGHT_SINGLE, x=20, y=100),
    ActionType.DRAG: Action(type=ActionType.DRAG, x=20, y=100, x2=60, y2=120),
    ActionType.HOTKEY: Action(type=ActionType.HOTKEY, key="ctrl a"),
    ActionType.TYPE: Action(type=ActionType.TYPE, text="abc\n"),
    ActionType.SCROLL: Action(type=ActionType.SCROLL, x=20, y=100, direction="down"),
    ActionType.WAIT: Action(type=ActionType.WAIT),
    ActionType.FINISHED: Action(type=ActionType.FINISHED, text="done"),
    ActionType.CALL_USER: Action(type=ActionType.CALL_USER),
}


def test_the_table_covers_every_action_type() -> None:
    assert set(EVERY_ACTION) == set(ActionType)


@pytest.mark.browser
@pytest.mark.parametrize("action_type", list(ActionType))
def test_miniwob_performs_every_action_type(
    miniwob_env: ThreadedEnv, action_type: ActionType
) -> None:
    miniwob_env.wait_seconds = 0.05
    miniwob_env.reset(
        TaskSpec(
            name="miniwob/click-dialog",
            env_kind="miniwob",
            env_config={"task": "click-dialog"},
            seed=1,
        )
    )
    obs = miniwob_env.step(EVERY_ACTION[action_type])
    assert obs.width == 160 and obs.screenshot_png.startswith(b"\x89PNG")


@pytest.mark.browser
def test_miniwob_typed_text_reaches_the_focused_field(miniwob_env: ThreadedEnv) -> None:
    obs = miniwob_env.reset(
        TaskSpec(
            name="miniwob/focus-text", env_kind="miniwob", env_config={"task": "focus-text"}, seed=1
        )
    )
    field = next(e for e in obs.metadata["dom_elements"] if e["tag"] == "input_text")
    miniwob_env.step(
        Action(type=ActionType.CLICK, x=int(field["left"] + 5), y=int(field["top"] + 5))
    )
    miniwob_env.reset(
        TaskSpec(
            name="miniwob/enter-text", env_kind="miniwob", env_config={"task": "enter-text"}, seed=1
        )
    )
    obs = miniwob_env.step(Action(type=ActionType.CLICK, x=30, y=66))
    obs = miniwob_env.step(Action(type=ActionType.TYPE, text="Hi"))
    field = next(e for e in obs.metadata["dom_elements"] if e["tag"] == "input_text")
    assert field["value"] == "Hi"


@pytest.mark.desktop
@pytest.mark.parametrize("action_type", list(ActionType))
def test_desktop_performs_every_action_type(
    desktop_env: DesktopEnv, action_type: ActionType
) -> None:
    desktop_env.wait_seconds = 0.05
    desktop_env.reset(
        TaskSpec(
            name="desktop/xterm-create-file",
            env_kind="desktop",
            env_config={"task": "desktop/xterm-create-file"},
        )
    )
    obs = desktop_env.step(EVERY_ACTION[action_type])
    assert obs.metadata["step"] == 1 and obs.screenshot_png.startswith(b"\x89PNG")


@pytest.mark.parametrize(("make_env", "point"), [(MiniWoBEnv, (500, 20)), (DesktopEnv, (900, 20))])
def test_off_screen_points_unknown_keys_and_long_texts_are_not_supported(make_env, point) -> None:
    env = make_env()  # never started: the checks happen before any browser/X call
    x, y = point
    with pytest.raises(ActionNotSupported, match=rf"click at \({x}, {y}\) is outside"):
        env.step(Action(type=ActionType.CLICK, x=x, y=y))
    with pytest.raises(ActionNotSupported, match="unknown key 'hyperspace'"):
        env.step(Action(type=ActionType.HOTKEY, key="ctrl hyperspace"))
    with pytest.raises(ActionNotSupported, match="type: 1001 characters; at most 1000"):
        env.step(Action(type=ActionType.TYPE, text="x" * 1001))
    env.close()
