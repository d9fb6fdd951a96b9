"""The `sim` backend: exact targets (the oracle succeeds through the model-image round trip,
a wrong click fails) and OSWorld latency, scaled."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from core.imaging import QWEN25_VL
from core.prompt_counter import PromptCounter
from core.protocol import Action, ActionType, TaskSpec
from envmanager.latency import PROFILES, LatencyEnv
from envmanager.oracle_policy import ObservedEnv, OracleEndpoint
from envmanager.oracles import oracle_action
from envmanager.sim_env import SimEnv, sim_task_records, target_boxes
from rollout.episode import EpisodeConfig, ListRecorder, play_episode


def _task(k: int, seed: int) -> TaskSpec:
    return TaskSpec(name=f"sim/click-{k}", env_kind="sim", env_config={"targets": k}, seed=seed)


@pytest.mark.parametrize("k", [1, 5, 12])
def test_the_oracle_clicks_every_box_in_order_through_the_policy_contract(k: int) -> None:
    env = SimEnv()
    oracle = OracleEndpoint(geometry=QWEN25_VL)
    for seed in range(5):
        recorder = ListRecorder()
        result = play_episode(
            env=ObservedEnv(env, oracle),
            policy=oracle,
            recorder=recorder,
            task=_task(k, seed),
            config=EpisodeConfig(step_cap=k + 2, prompt_counter=PromptCounter.bound(QWEN25_VL)),
        )
        assert (result.status, result.reward, result.end_reason) == ("succeeded", 1.0, "env_done")
        assert len(recorder.steps) == k  # one click per box, nothing after the last


def test_a_click_beside_the_box_fails_the_episode() -> None:
    env = SimEnv()
    obs = env.reset(_task(3, seed=7))
    _, top, right, _ = obs.metadata["targets"][0]
    obs = env.step(Action(type=ActionType.CLICK, x=right, y=top))  # right edge is outside
    assert obs.done
    assert env.evaluate().reward == 0.0
    assert env.evaluate().details == {"clicked": 0, "misses": 1}


def test_clicking_the_boxes_out_of_order_fails() -> None:
    env = SimEnv()
    obs = env.reset(_task(2, seed=3))
    second = obs.metadata["targets"][1]
    env.step(Action(type=ActionType.CLICK, x=second[0] + 1, y=second[1] + 1))
    assert not env.evaluate().success


def test_a_group_sees_the_same_screen_and_other_seeds_another() -> None:
    a, b = SimEnv(), SimEnv()
    assert a.reset(_task(4, 11)).screenshot_png == b.reset(_task(4, 11)).screenshot_png
    assert target_boxes(seed=11, count=4) != target_boxes(seed=12, count=4)
    obs = a.reset(_task(4, 11))
    action = oracle_action(env_kind="sim", task_name="sim/click-4", observation=obs)
    assert action is not None
    assert a.step(action).screenshot_png != obs.screenshot_png  # the clicked box greys out


def test_a_task_can_ask_for_a_full_hd_screen_and_the_oracle_still_solves_it() -> None:
    env = SimEnv()
    oracle = OracleEndpoint(geometry=QWEN25_VL)
    task = TaskSpec(
        name="sim/click-3", env_kind="sim", env_config={"targets": 3, "width": 1920, "height": 1080}
    )
    obs = env.reset(task)
    assert (obs.width, obs.height) == (1920, 1080)
    assert Image.open(io.BytesIO(obs.screenshot_png)).size == (1920, 1080)
    assert max(box[2] for box in obs.metadata["targets"]) > 320  # the whole screen is used
    result = play_episode(
        env=ObservedEnv(env, oracle),
        policy=oracle,
        recorder=ListRecorder(),
        task=task,
        config=EpisodeConfig(step_cap=5, prompt_counter=PromptCounter.bound(QWEN25_VL)),
    )
    assert (result.status, result.steps) == ("succeeded", 3)
    with pytest.raises(ValueError, match="a screen of 100x1080"):
        env.reset(TaskSpec(name="sim/x", env_kind="sim", env_config={"width": 100, "height": 1080}))


def test_osworld_latency_scaled() -> None:
    profile = PROFILES["osworld"].scaled(0.002)  # resets 40-120 ms, steps 4-10 ms
    env = LatencyEnv(SimEnv(), profile, seed=0)
    t0 = time.perf_counter()
    obs = env.reset(_task(1, 0))
    reset_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    env.step(Action(type=ActionType.CLICK, x=obs.width - 1, y=obs.height - 1))
    step_s = time.perf_counter() - t0
    # The latency is applied (lower bounds) and scaled: unscaled, a reset waits 20 s or more
    # and a step 2 s; the upper bounds only tell scaled from unscaled (the benches time it).
    assert 0.040 <= reset_s < 10.0
    assert 0.004 <= step_s < 1.0


def test_make_env_gives_sim_the_scaled_osworld_latency(settings) -> None:
    from workers.env_cache import make_env

    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.5
    env = make_env("sim")
    assert isinstance(env, LatencyEnv)
    assert env.profile == PROFILES["osworld"].scaled(0.5)
    assert env.kind == "sim"


def test_builtin_sim_tasks_parse_and_cover_one_to_twelve_boxes() -> None:
    from datamanager.task_import import parse_task_record

    records = [parse_task_record(r, "sim") for r in sim_task_records()]
    train = sorted(r.env_config["targets"] for r in records if r.split == "train")
    assert train == list(range(1, 13))
    assert all(r.env_config["max_steps"] == r.env_config["targets"] + 2 for r in records)
