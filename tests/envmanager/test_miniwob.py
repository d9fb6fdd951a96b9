"""MiniWoB++ backend on real headless chromium: oracles, rewards, observations, faults."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from core.prompt_counter import PromptCounter
from core.protocol import Action, ActionType, EnvUnavailable, TaskSpec
from envmanager.miniwob_env import SCREEN_HEIGHT, SCREEN_WIDTH, MiniWoBEnv, png_size
from envmanager.miniwob_tasks import (
    ALWAYS_TRAIN,
    STARTER_TASKS,
    miniwob_split,
    miniwob_task_names,
    miniwob_task_records,
)
from envmanager.threaded import ThreadedEnv
from training.tiny_policy import TINY_GEOMETRY


def miniwob_spec(subdomain: str, seed: int = 0) -> TaskSpec:
    return TaskSpec(
        name=f"miniwob/{subdomain}", env_kind="miniwob", env_config={"task": subdomain}, seed=seed
    )


ORACLE_TASKS = [*STARTER_TASKS, "enter-text", "click-checkboxes", "login-user"]


@pytest.mark.browser
@pytest.mark.parametrize("subdomain", ORACLE_TASKS)
def test_oracle_episode_reaches_reward_one(
    miniwob_env: ThreadedEnv, oracle_episode, subdomain: str
) -> None:
    for seed in (1, 2):
        evaluation, steps = oracle_episode(miniwob_env, miniwob_spec(subdomain, seed))
        assert evaluation.reward == 1.0, evaluation.details
        assert evaluation.success and evaluation.details["raw_reward"] > 0
        assert steps >= 1


@pytest.mark.browser
def test_random_actions_score_lower_than_the_oracle(miniwob_env: ThreadedEnv) -> None:
    rng = random.Random(0)
    tasks = ["click-link", "click-button", "enter-text", "click-checkboxes", "login-user"]
    rewards = []
    for i, subdomain in enumerate(tasks):
        miniwob_env.reset(miniwob_spec(subdomain, seed=100 + i))
        for _ in range(3):
            miniwob_env.step(
                Action(
                    type=ActionType.CLICK,
                    x=rng.randrange(SCREEN_WIDTH),
                    y=rng.randrange(SCREEN_HEIGHT),
                )
            )
        rewards.append(miniwob_env.evaluate().reward)
    assert sum(rewards) / len(rewards) < 0.5, rewards


@pytest.mark.browser
def test_observation_has_screenshot_instruction_fields_and_dom(miniwob_env: ThreadedEnv) -> None:
    obs = miniwob_env.reset(miniwob_spec("click-button", seed=7))
    assert (obs.width, obs.height) == (160, 210)
    assert png_size(png=obs.screenshot_png) == (160, 210)
    assert obs.instruction.startswith("Click on the")
    target = obs.metadata["fields"]["target"]
    assert target in obs.instruction
    buttons = [e for e in obs.metadata["dom_elements"] if e["tag"] == "button"]
    assert any(b["text"] == target for b in buttons)
    assert all(0 <= b["left"] < 160 and 0 <= b["top"] < 210 for b in buttons)
    assert obs.metadata["done"] is False


@pytest.mark.browser
def test_same_seed_gives_same_task_instance(miniwob_env: ThreadedEnv) -> None:
    first = miniwob_env.reset(miniwob_spec("click-button", seed=42)).instruction
    miniwob_env.reset(miniwob_spec("click-link", seed=3))
    again = miniwob_env.reset(miniwob_spec("click-button", seed=42)).instruction
    assert first == again


@pytest.mark.browser
def test_switching_tasks_reuses_one_browser(miniwob_env: ThreadedEnv) -> None:
    miniwob_env.reset(miniwob_spec("click-test"))
    pid = miniwob_env.backend.browser_pid()
    miniwob_env.reset(miniwob_spec("focus-text"))
    assert pid is not None and miniwob_env.backend.browser_pid() == pid


@pytest.mark.browser
def test_unfinished_and_failed_episodes_score_zero(miniwob_env: ThreadedEnv) -> None:
    miniwob_env.reset(miniwob_spec("click-test-2", seed=5))
    unfinished = miniwob_env.evaluate()
    assert unfinished.reward == 0.0 and unfinished.details["reason"] == "episode not finished"
    obs = miniwob_env.reset(miniwob_spec("click-test-2", seed=5))
    target = obs.metadata["fields"]["target"]
    wrong = next(
        e for e in obs.metadata["dom_elements"] if e["tag"] == "button" and e["text"] != target
    )
    miniwob_env.step(
        Action(type=ActionType.CLICK, x=int(wrong["left"] + 5), y=int(wrong["top"] + 5))
    )
    failed = miniwob_env.evaluate()
    assert failed.reward == 0.0 and not failed.success
    assert failed.details["raw_reward"] == -1.0


@pytest.mark.browser
@pytest.mark.slow
def test_killed_browser_surfaces_as_unavailable_then_recreate_works(oracle_episode) -> None:
    env = MiniWoBEnv(timeout_s=5.0)
    try:
        env.reset(miniwob_spec("click-test"))
        pid = env.browser_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EnvUnavailable, match="miniwob"):
            env.step(Action(type=ActionType.CLICK, x=10, y=10))
        assert time.monotonic() - started < 10
        env.recreate()
        evaluation, _ = oracle_episode(env, miniwob_spec("click-button", seed=1))
        assert evaluation.reward == 1.0
    finally:
        env.close()


def test_task_catalogue_and_split_are_deterministic() -> None:
    names = miniwob_task_names()
    assert len(names) == 125 and "click-test" in names
    records = miniwob_task_records()
    assert [r["name"] for r in records] == [f"miniwob/{n}" for n in names]
    assert all(r["env_kind"] == "miniwob" and r["instruction"] == "" for r in records)
    assert all(
        r["env_config"] == {"task": r["name"].removeprefix("miniwob/"), "episode_seconds": 60}
        for r in records
    )
    assert all(r["split"] in ("train", "eval") and r["tags"] for r in records)
    eval_share = sum(r["split"] == "eval" for r in records) / len(records)
    assert 0.1 < eval_share < 0.3
    assert all(miniwob_split(name=n) == "train" for n in ALWAYS_TRAIN)
    assert miniwob_task_records() == records


class _RepeatFirstAnswer:
    """A policy that never says finished(): it repeats its first answer (the oracle's click,
    or a fixed text) at every step."""

    def __init__(self, first) -> None:
        self.first = first
        self.text: str | None = None

    def complete(self, messages, **_):
        from core.completion import Completion

        started = time.perf_counter()
        if self.text is None:
            self.text = self.first(messages)
        return Completion.scripted(self.text, started=started, served_by="test")


def test_episode_ends_when_the_task_ends_itself(miniwob_env: ThreadedEnv) -> None:
    """A MiniWoB++ task is over after its click: the runner stops there (env_done) instead
    of asking the policy again until the step cap; an off-target click that does not end
    the task leaves the episode running."""
    from envmanager.oracle_policy import ObservedEnv, OracleEndpoint
    from rollout.episode import EpisodeConfig, ListRecorder, play_episode

    config = EpisodeConfig(step_cap=3, prompt_counter=PromptCounter.bound(TINY_GEOMETRY))
    oracle = OracleEndpoint(geometry=config.image_geometry)
    clicker = _RepeatFirstAnswer(lambda messages: oracle.complete(messages).text)
    recorder = ListRecorder()
    result = play_episode(
        env=ObservedEnv(miniwob_env, oracle), policy=clicker, recorder=recorder,
        task=miniwob_spec("click-test", seed=4), config=config,
    )  # fmt: skip
    assert (result.status, result.end_reason, result.steps) == ("succeeded", "env_done", 1)
    assert len(recorder.steps) == 1

    corner = _RepeatFirstAnswer(
        lambda _: "Action: click(start_box='<|box_start|>(2,2)<|box_end|>')"
    )
    recorder = ListRecorder()
    result = play_episode(
        env=miniwob_env, policy=corner, recorder=recorder,
        task=miniwob_spec("click-test", seed=4), config=config,
    )  # fmt: skip
    assert (result.status, result.end_reason, result.steps) == ("failed", "step_cap", 3)


def test_a_paced_episode_asks_the_policy_only_once_the_batch_is_at_that_turn(
    miniwob_env: ThreadedEnv,
) -> None:
    """The synchronous baseline's lockstep on a real episode: a second member that reaches
    each turn 0.4 s late holds the episode's policy call of that turn until it arrives, and
    the episode leaves the round after its last turn."""
    import threading
    import uuid

    import redis
    from django.conf import settings

    from rollout.episode import EpisodeConfig, ListRecorder, play_episode
    from workers.lockstep import RedisLockstep

    key = f"dartboard:lockstep:test:{uuid.uuid4().hex}"

    def pacer() -> RedisLockstep:
        return RedisLockstep(redis_url=settings.REDIS_URL, key=key, members=2, timeout_s=20)

    late_arrivals: list[float] = []

    def late_member() -> None:
        other = pacer()
        for t in range(3):
            time.sleep(0.4)
            late_arrivals.append(time.monotonic())
            other.turn(t)
        other.leave()

    calls: list[float] = []
    corner = _RepeatFirstAnswer(
        lambda _: "Action: click(start_box='<|box_start|>(2,2)<|box_end|>')"
    )

    class Timed:
        def complete(self, messages, **kw):
            calls.append(time.monotonic())
            return corner.complete(messages, **kw)

    thread = threading.Thread(target=late_member)
    thread.start()
    result = play_episode(
        env=miniwob_env, policy=Timed(), recorder=ListRecorder(),
        task=miniwob_spec("click-test", seed=4), pacer=pacer(),
        config=EpisodeConfig(step_cap=3, prompt_counter=PromptCounter.bound(TINY_GEOMETRY)),
    )  # fmt: skip
    thread.join(timeout=20)
    assert (result.end_reason, result.steps) == ("step_cap", 3)
    assert len(calls) == 3 and len(late_arrivals) == 3
    assert all(call >= arrival for call, arrival in zip(calls, late_arrivals, strict=True))
    r = redis.Redis.from_url(settings.REDIS_URL)
    assert [int(r.get(f"{key}:at:{t}")) for t in range(3)] == [2, 2, 2]
    assert r.hgetall(f"{key}:left") == {b"2": b"2"}
