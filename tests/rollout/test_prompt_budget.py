"""A UI-TARS-1.5 episode of 30 steps on full-HD screens through both backends on the CPU, with
no prompt-length error: a Qwen2.5-VL checkpoint with UI-TARS-1.5's image geometry (a
1920x1080 screenshot is 2,691 tokens), prompted with its template, served by the transformers
server and by vLLM's CPU build behind its adapter, each started at the run's own limits
(`ServingLimits.for_run`), as the host agent starts a run's workers. The run keeps 5
screenshots within the smallest prompt budget the UI-TARS-1.5 prompt takes, so the history
passes it: the oldest screenshots go first, and every prompt the servers tokenized (the
`prompt_token_ids` a step stores) is within the budget, to the token the counter said."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from django.conf import settings

from core.imaging import QWEN25_VL
from core.prompt_counter import PromptCounter
from core.prompts import PROMPT_TEMPLATES, HistoryTurn, build_messages, prompt_steps_shown
from core.protocol import TaskSpec
from core.steps import StepRecord
from datamanager.config import UI_TARS_MIN_NEW_TOKENS, UI_TARS_MIN_PROMPT_TOKENS, RunConfig
from envmanager.sim_env import SimEnv
from hostagent.launcher import Supervisor, vllm_specs
from rollout.auth import ServiceTokens
from rollout.client import PolicyClient, PromptTooLong
from rollout.episode import EndReason, EpisodeResult, ListRecorder, play_episode
from rollout.limits import ServingLimits
from rollout.local_server import LocalPolicyServer
from rollout.vllm_command import vllm_missing
from tests.helpers import free_port, needs, wait_until
from tests.rollout.test_vllm_cpu import _models_listed
from workers.config_mapping import episode_config

pytestmark = pytest.mark.slow
STEPS = 30
MAX_IMAGES = 5
REPLY = 96
TASK = TaskSpec(
    name="sim/click-3",
    env_kind="sim",
    env_config={"targets": 3, "width": 1920, "height": 1080},
    instruction="Click the boxes 1 to 3 in order.",
    seed=0,
)


@pytest.fixture(scope="module")
def ui_tars() -> Path:
    """UI-TARS-1.5's architecture, image geometry and template at CPU widths; its vision
    blocks attend within windows only, so five full-HD screens a step cost seconds, not
    minutes."""
    from training.tiny_policy import build_tiny_policy

    out = Path(settings.DARTBOARD_HOME) / "policies" / "ui-tars-tiny"
    return build_tiny_policy(out, seed=0, arch="qwen2_5_vl", hidden=64, heads=1, kv_heads=1,
                             layers=1, intermediate=128, vision_hidden=32, vision_heads=1,
                             vision_depth=1, fullatt_blocks=(), geometry=QWEN25_VL)  # fmt: skip


@pytest.fixture(scope="module")
def run(ui_tars) -> RunConfig:
    """A UI-TARS-1.5 run at the smallest prompt budget and reply its prompt is let have."""
    return RunConfig.from_dict(
        {
            "policy": str(ui_tars),
            "rollout": {
                "prompt": "ui-tars-1.5",
                "max_images": MAX_IMAGES,
                "max_new_tokens": UI_TARS_MIN_NEW_TOKENS,
                "max_prompt_tokens": UI_TARS_MIN_PROMPT_TOKENS,
                # A random model writes no action: its parse errors must not end the episode.
                "max_parse_errors": STEPS + 1,
            },
        }
    )


@pytest.fixture(scope="module")
@needs("live")
def backends(ui_tars, run) -> Iterator[dict[str, str]]:
    """Both backends' URLs, each started at the run's own limits."""
    if missing := vllm_missing():
        pytest.fail(missing)
    r = run.rollout
    limits = ServingLimits.for_run(max_new_tokens=r.max_new_tokens, max_images=r.max_images,
                                   max_prompt_tokens=r.max_prompt_tokens, lora_rank=0)  # fmt: skip
    tokens = ServiceTokens(settings.DARTBOARD_INFERENCE_TOKEN, settings.DARTBOARD_ADMIN_TOKEN)
    port = free_port()
    specs = vllm_specs(0, str(ui_tars), port, tokens=tokens, prefix="uit-", limits=limits)
    supervisor = Supervisor(home=Path(settings.DARTBOARD_HOME), specs=specs, group="uit")
    supervisor.start()
    vllm = f"http://127.0.0.1:{port}"
    try:
        with LocalPolicyServer(ui_tars, tokens=tokens, extra_args=limits.server_args()) as hf:
            wait_until(lambda: _models_listed(vllm, tokens), timeout=300, interval=1.0,
                       what="vLLM serving the UI-TARS-shaped checkpoint")  # fmt: skip
            yield {"transformers": hf, "vllm": vllm}
    finally:
        supervisor.stop()
        for name in ("uit-vllm-0", "uit-inference-0"):  # kept for a failure's reader
            log = Path(settings.DARTBOARD_HOME) / "logs" / f"{name}.log"
            if log.exists():
                shutil.copy(log, Path(tempfile.gettempdir()) / f"dartboard-test-{name}.log")


def counted(counter: PromptCounter, steps: list[StepRecord], prompt: list[dict]) -> int:
    """What the counter made of a stored prompt (its images are its steps' screenshots)."""
    total = counter.reply
    for message in prompt:
        if isinstance(message["content"], str):
            total += counter.text(role=message["role"], text=message["content"])
        else:
            (part,) = message["content"]
            total += counter.image(steps[part["step"]].screenshot_png)
    return total


def test_a_30_step_ui_tars_episode_on_full_hd_screens_passes_no_prompt_limit(
    ui_tars, run, backends
) -> None:
    # Replies cut at REPLY tokens: the run's own 256 would make the CPU decode for longer, and
    # the history passes the budget either way.
    config = replace(episode_config(run, step_cap=STEPS, seed=0), max_new_tokens=REPLY)
    counter = config.prompt_counter
    budget = run.rollout.max_prompt_tokens
    results: dict[str, EpisodeResult | BaseException] = {}
    recorders = {name: ListRecorder() for name in backends}

    def play(name: str) -> None:
        try:
            with PolicyClient(backends[name], timeout=300) as client:
                results[name] = play_episode(env=SimEnv(), policy=client, recorder=recorders[name],
                                             task=TASK, config=config)  # fmt: skip
        except BaseException as exc:  # the test's finding, reported below
            results[name] = exc

    # Side by side: each backend's process decodes on its own core.
    threads = [threading.Thread(target=play, args=(name,)) for name in backends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pressed = {}
    for name, result in results.items():
        assert isinstance(result, EpisodeResult), f"{name}: {result!r}"
        steps = recorders[name].steps
        assert result.end_reason == EndReason.STEP_CAP and len(steps) == STEPS, (name, result)
        assert "prompts_refused" not in result.details
        pressed[name] = 0
        for step in steps:
            assert step.screenshot_png and (step.width, step.height) == (1920, 1080)
            i = step.index
            tokens = len(step.prompt_token_ids)
            assert tokens == counted(counter, steps, step.prompt) <= budget, (name, i)
            shown = prompt_steps_shown(step.prompt)
            texts = [m["content"] for m in step.prompt if m["role"] == "assistant"]
            # The screenshots shown are the last ones, the current screen always among them;
            # the texts kept are the last turns'; a text goes only once no earlier screen is left.
            assert shown == list(range(i + 1 - len(shown), i + 1)) and len(shown) <= MAX_IMAGES
            assert texts == [
                HistoryTurn.from_output(s.raw_output).text for s in steps[i - len(texts) : i]
            ]
            assert len(texts) == i or shown == [i], (name, i, shown, len(texts))
            pressed[name] += len(shown) < min(MAX_IMAGES, i + 1)
    seconds = {name: round(r.model_ms / 1000) for name, r in results.items()}  # type: ignore[union-attr]
    print(f"\nsteps whose oldest screenshots the budget of {budget} dropped: {pressed}; "
          f"policy seconds {seconds}")  # fmt: skip
    assert all(pressed.values())  # the budget was met by dropping screenshots, on both

    # A prompt past vLLM's context (built with no budget) is refused with the code on which
    # the episode sends it again, as rollout.server refuses one past its limit.
    digits = [HistoryTurn(thought="1234567890" * 100, action_text="wait()")] * (MAX_IMAGES - 1)
    screen = recorders["vllm"].steps[0].screenshot_png
    too_long = build_messages(instruction=TASK.instruction, history=digits,
                              screenshots=[screen] * MAX_IMAGES, max_images=MAX_IMAGES,
                              template=PROMPT_TEMPLATES["ui-tars-1.5"])  # fmt: skip
    with (
        PolicyClient(backends["vllm"], timeout=120) as client,
        pytest.raises(PromptTooLong, match="maximum context length"),
    ):
        client.complete(too_long, max_tokens=8)


@pytest.mark.live  # a transformers server of its own
def test_a_prompt_refused_for_its_length_is_sent_again_with_less_history(ui_tars, run) -> None:
    """A worker whose limit is below the run's budget (started for another run, or counting
    with a tokenizer of another version): the episode goes on, each refused prompt sent once
    more with its text counted at the byte bound, and the refusals are on the trajectory."""
    counter = PromptCounter.from_policy_dir(ui_tars)
    task = replace(TASK, env_config={"targets": 3})  # 320x200 screens: a cheap step
    template = PROMPT_TEMPLATES[run.rollout.prompt]
    head = template.first_user_message(instruction=TASK.instruction, language="English")
    least = (  # system, instruction and the current (320x200) screen
        counter.text(role="system", text=template.system)
        + counter.text(role="user", text=head)
        + counter.image(SimEnv().reset(task).screenshot_png)
        + counter.reply
    )
    limit = least + 150  # a turn or two of history
    config = replace(
        episode_config(run, step_cap=4, seed=0),
        max_prompt_tokens=limit + 100,
        max_new_tokens=32,
    )
    recorder = ListRecorder()
    with (
        LocalPolicyServer(ui_tars, extra_args=["--max-prompt-tokens", str(limit)]) as url,
        PolicyClient(url, timeout=120) as client,
    ):
        result = play_episode(
            env=SimEnv(), policy=client, recorder=recorder, task=task, config=config
        )
    assert (result.end_reason, result.steps) == (EndReason.STEP_CAP, 4)
    refused = result.details["prompts_refused"]
    assert refused and all(f"at most {limit}" in r["refusal"] for r in refused)
    for r in refused:
        step = recorder.steps[r["step"]]
        assert len(step.prompt_token_ids) <= limit
        assert [m["role"] for m in step.prompt] == ["system", "user", "user"]  # no history left
    assert all(len(s.prompt_token_ids) <= limit for s in recorder.steps)
