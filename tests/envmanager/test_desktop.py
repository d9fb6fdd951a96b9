"""Desktop backend on a real Xvfb + openbox: oracle episodes, checkers, faults."""

from __future__ import annotations

import os
import signal

import pytest

from core.protocol import Action, ActionNotSupported, ActionType, EnvUnavailable, TaskSpec
from envmanager.desktop_env import HEIGHT, WIDTH, DesktopEnv
from envmanager.desktop_tasks import DESKTOP_TASKS, desktop_task_records
from envmanager.miniwob_env import png_size


def desktop_spec(name: str) -> TaskSpec:
    return TaskSpec(name=name, env_kind="desktop", env_config={"task": name})


@pytest.mark.desktop
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DESKTOP_TASKS))
def test_oracle_solves_every_desktop_task(
    desktop_env: DesktopEnv, oracle_episode, name: str
) -> None:
    evaluation, steps = oracle_episode(desktop_env, desktop_spec(name))
    assert evaluation.reward == 1.0, evaluation.details
    assert steps == len(DESKTOP_TASKS[name].oracle_plan)


@pytest.mark.desktop
@pytest.mark.parametrize("name", sorted(DESKTOP_TASKS))
def test_checker_gives_zero_for_the_untouched_state(desktop_env: DesktopEnv, name: str) -> None:
    obs = desktop_env.reset(desktop_spec(name))
    assert obs.instruction == DESKTOP_TASKS[name].instruction
    assert png_size(png=obs.screenshot_png) == (WIDTH, HEIGHT)
    evaluation = desktop_env.evaluate()
    assert evaluation.reward == 0.0 and not evaluation.success


@pytest.mark.desktop
def test_checker_gives_zero_for_wrong_saved_text(desktop_env: DesktopEnv) -> None:
    desktop_env.reset(desktop_spec("desktop/editor-type-save"))
    for action in [
        Action(type=ActionType.CLICK, x=400, y=300),
        Action(type=ActionType.TYPE, text="goodbye desktop"),
        Action(type=ActionType.HOTKEY, key="ctrl s"),
    ]:
        obs = desktop_env.step(action)
    evaluation = desktop_env.evaluate()
    assert evaluation.reward == 0.0
    assert evaluation.details["content"] == "goodbye desktop"
    assert any("(saved)" in title for title in obs.metadata["windows"])


@pytest.mark.desktop
def test_reset_closes_the_previous_tasks_windows(desktop_env: DesktopEnv) -> None:
    desktop_env.reset(desktop_spec("desktop/xterm-create-file"))
    obs = desktop_env.reset(desktop_spec("desktop/double-click"))
    assert obs.metadata["windows"] == ["dartpad"]


@pytest.mark.desktop
@pytest.mark.slow
def test_killed_xvfb_surfaces_as_unavailable_then_recreate_works(oracle_episode) -> None:
    env = DesktopEnv(evaluate_wait_s=0.5)
    try:
        env.reset(desktop_spec("desktop/right-click"))
        pid = env.xvfb_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        env._x.xvfb.wait(timeout=5)  # the kill has landed before the next step
        with pytest.raises(EnvUnavailable, match="Xvfb"):
            env.step(Action(type=ActionType.CLICK, x=10, y=10))
        env.recreate()
        evaluation, _ = oracle_episode(env, desktop_spec("desktop/right-click"))
        assert evaluation.reward == 1.0
    finally:
        env.close()


def test_desktop_task_records_are_importable() -> None:
    records = desktop_task_records()
    assert len(records) >= 8
    for record in records:
        assert record["name"].startswith("desktop/")
        assert record["env_kind"] == "desktop"
        assert record["env_config"] == {"task": record["name"]}
        assert record["instruction"] and record["split"] in ("train", "eval") and record["tags"]


@pytest.mark.desktop
@pytest.mark.slow  # loads the desktop policy and plays two episodes: ~20 s
@pytest.mark.parametrize("name", ["desktop/right-click", "desktop/editor-type-save"])
def test_the_desktop_policy_does_a_real_desktop_task_greedily(
    desktop_env: DesktopEnv, desktop_policy, name: str
) -> None:
    """What synthetic desktop pretraining is for: on the real desktop, with `make
    run-desktop`'s rollout settings, the shipped desktop policy right-clicks the pad, and
    clicks, types the instruction's text, saves and says it is done in the editor
    (bench/desktop.py measures all 7 tasks; the MiniWoB++-only policy does neither)."""
    from bench.desktop import play, preset_episode_config

    result = play(
        desktop_env,
        desktop_policy,
        task=name,
        config=preset_episode_config(desktop_policy.counter),
    )
    assert result["success"], result["actions"]


@pytest.mark.desktop
@pytest.mark.parametrize(
    "text",
    ["café au lait", "naïve résumé", "日本語のテキスト", "tab\there, two\nlines", "thumbs 👍"],
)
def test_text_in_any_script_is_typed_and_saved(desktop_env: DesktopEnv, text: str) -> None:
    desktop_env.reset(desktop_spec("desktop/editor-type-save"))
    for action in [
        Action(type=ActionType.CLICK, x=400, y=300),
        Action(type=ActionType.TYPE, text=text),
        Action(type=ActionType.HOTKEY, key="ctrl s"),
    ]:
        desktop_env.step(action)
    assert desktop_env.evaluate().details["content"] == text


@pytest.mark.desktop
def test_a_control_character_is_refused_by_name_and_the_desktop_goes_on(
    desktop_env: DesktopEnv,
) -> None:
    desktop_env.reset(desktop_spec("desktop/editor-type-save"))
    desktop_env.step(Action(type=ActionType.CLICK, x=400, y=300))
    with pytest.raises(ActionNotSupported, match=r"U\+0007 \(BEL\) cannot be typed"):
        desktop_env.step(Action(type=ActionType.TYPE, text="ding\x07"))
    desktop_env.step(Action(type=ActionType.TYPE, text="hello desktop"))
    desktop_env.step(Action(type=ActionType.HOTKEY, key="ctrl s"))
    assert desktop_env.evaluate().reward == 1.0
