"""The policy's text is untrusted: 10,000 random and mutated model outputs go through parsing
and coordinate mapping, and a sample of them through real MiniWoB++ and desktop steps. No
crash, no hang, and every failure is recorded on its step with a reason."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from core.actions import ActionParseError, parse_output, to_screen
from core.completion import Completion
from core.imaging import QWEN25_VL
from core.prompt_counter import PromptCounter
from core.protocol import TaskSpec
from envmanager.desktop_env import DesktopEnv
from envmanager.threaded import ThreadedEnv
from rollout.episode import EpisodeConfig, ListRecorder, play_episode
from training.tiny_policy import TINY_GEOMETRY

SEEDS = [
    "Thought: the OK button\nAction: click(start_box='<|box_start|>(84,120)<|box_end|>')",
    "Action: left_double(start_box='<|box_start|>(10,10)<|box_end|>')",
    "Action: right_single(start_box='(5,7)')",
    "Action: drag(start_box='<|box_start|>(1,2)<|box_end|>', end_box='<|box_start|>(90,80)<|box_end|>')",
    "Action: hotkey(key='ctrl a')",
    "Action: type(content='hello\\n')",
    "Action: scroll(start_box='<|box_start|>(50,60)<|box_end|>', direction='down')",
    "Action: wait()",
    "Action: finished(content='done')",
    "Action: call_user()",
    "Action: click(start_box='<point>300 400</point>')",
]  # fmt: skip
ALPHABET = "()<>|',=\\\"_:\n\t -+0123456789abcxyz\u202e\u200b\U0001f600\x00"


def mutate(text: str, rng: random.Random) -> str:
    """One random mutation of a model output."""
    kind = rng.randrange(9)
    i = rng.randrange(len(text) + 1)
    if kind == 0:
        return text[:i]  # truncated mid-token
    if kind == 1:
        return text[:i] + rng.choice(ALPHABET) + text[i:]
    if kind == 2:
        return text[:i] + text[i + 1 :]
    if kind == 3:  # a number grows absurd, or negative
        return "".join(
            rng.choice(["9" * rng.randrange(1, 40), "-" + c]) if c.isdigit() else c for c in text
        )
    if kind == 4:
        return text + text[: rng.randrange(len(text) + 1)]  # two actions glued together
    if kind == 5:
        return text.replace("'", rng.choice(['"', "", "''", "\\'"]))
    if kind == 6:
        return text.replace("(", "(" * rng.randrange(1, 5))
    if kind == 7:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 200)))
    return text.replace("content='", "content='" + "x" * rng.randrange(1, 20_000))


def outputs(n: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n):
        text = rng.choice(SEEDS)
        for _ in range(rng.randrange(1, 4)):
            text = mutate(text, rng)
        yield text


def test_ten_thousand_outputs_parse_to_an_action_on_screen_or_fail_with_a_reason() -> None:
    screens = [(160, 210), (800, 600), (1920, 1080)]
    parsed = failed = 0
    for n, text in enumerate(outputs(10_000, seed=0)):
        try:
            action = parse_output(text).action
        except ActionParseError as exc:
            assert str(exc), f"output {n} failed without a reason: {text!r}"
            failed += 1
            continue
        parsed += 1
        width, height = screens[n % 3]
        mapped = to_screen(
            action,
            screen_size=(width, height),
            model_size=QWEN25_VL.model_size(width=width, height=height),
        )
        for x, y in ((mapped.x, mapped.y), (mapped.x2, mapped.y2)):
            if x is not None:
                assert 0 <= x < width and 0 <= y < height, (text, mapped)
    assert parsed > 1000 and failed > 1000  # the mix exercises both paths


class Scripted:
    """A policy endpoint that answers with the next fuzzed output."""

    def __init__(self, texts: Iterator[str]) -> None:
        self.texts = texts

    def complete(self, messages, **_) -> Completion:
        return Completion.scripted(next(self.texts), started=time.perf_counter(), served_by="fuzz")


@pytest.mark.browser
@pytest.mark.slow
def test_fuzzed_outputs_step_real_miniwob_and_desktop_envs_and_each_failure_is_recorded(
    miniwob_env: ThreadedEnv, desktop_env: DesktopEnv
) -> None:
    cases = [
        (miniwob_env, TaskSpec(name="miniwob/click-test", env_kind="miniwob",
                               env_config={"task": "click-test"}, seed=1), 200),
        (desktop_env, TaskSpec(name="desktop/xterm-create-file", env_kind="desktop",
                               env_config={"task": "desktop/xterm-create-file"}), 40),
    ]  # fmt: skip
    for env, task, n in cases:
        texts = outputs(n, seed=7)
        recorded = []
        steps = 0
        while steps < n:  # a finished() or a task the env ends itself starts a new episode
            config = EpisodeConfig(
                step_cap=n - steps,
                max_parse_errors=n + 1,
                max_images=1,
                prompt_counter=PromptCounter.bound(TINY_GEOMETRY),
            )
            started = time.monotonic()
            recorder = ListRecorder()
            result = play_episode(
                env=env, policy=Scripted(texts), recorder=recorder, task=task, config=config
            )
            recorded += recorder.steps
            steps += result.steps
            assert time.monotonic() - started < 60 + 2 * n  # no step hangs
        assert len(recorded) == n
        for step in recorded:
            # Every step is either a performed action or a no-op with its reason recorded.
            assert (step.action is None) == bool(step.parse_error), step
            if step.parse_error:
                assert step.parse_error.strip()
        performed = sum(1 for s in recorded if s.action)
        refused = sum(1 for s in recorded if s.parse_error)
        assert performed and refused, (task.name, performed, refused)
    assert desktop_env.evaluate() is not None  # the desktop still answers
