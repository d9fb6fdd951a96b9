"""A checkpoint's `generation_config.json` never steers Dartboard's sampling: Qwen2.5-VL-7B-
Instruct ships top_k=1 and repetition_penalty=1.05, which would make every rollout of a group
the same (zero advantages) and sample from a distribution other than the one whose log-probs
are recorded. (vLLM gets `--generation-config vllm`: `rollout.vllm_command`.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.generation import generate
from core.policy import load_policy
from core.prompts import build_messages
from tests.conftest import png_bytes

SHIPPED = Path(__file__).resolve().parents[2] / "policies" / "tiny-grounded"

pytestmark = pytest.mark.slow  # loads the shipped policy and generates: ~10 s


@pytest.fixture(scope="module")
def steering_policy(tmp_path_factory):
    """The shipped policy with a generation config that would steer every choice: top_k=1,
    and a repetition penalty far above Qwen's 1.05 so its effect cannot hide."""
    path = tmp_path_factory.mktemp("steering") / "policy"
    shutil.copytree(SHIPPED, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(top_k=1, top_p=0.001, temperature=0.01, repetition_penalty=50.0)
    (path / "generation_config.json").write_text(json.dumps(config))
    return load_policy(path)


def _messages():
    return build_messages(
        instruction="Click the button.", history=[], screenshots=[png_bytes(160, 210)]
    )


def test_greedy_takes_the_argmax_of_the_recorded_log_probs(steering_policy) -> None:
    (gen,) = generate(steering_policy, [_messages()], max_new_tokens=24, greedy=True,
                      top_logprobs=1)  # fmt: skip
    assert gen.top_logprobs is not None and len(gen.token_ids) >= 4
    for token, logprob, best in zip(gen.token_ids, gen.token_logprobs, gen.top_logprobs,
                                    strict=True):  # fmt: skip
        assert (token, logprob) == best[0]  # no penalty moved the choice off the raw argmax


def test_samples_of_a_group_differ_under_a_top_k_1_generation_config(steering_policy) -> None:
    gens = generate(steering_policy, [_messages()] * 6, max_new_tokens=24, seed=list(range(6)))
    assert len({tuple(g.token_ids) for g in gens}) > 1
