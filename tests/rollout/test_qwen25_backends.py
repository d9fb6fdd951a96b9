"""A Qwen2.5-VL checkpoint on both backends, as a user's own model is served: the stand-in
`manage.py make_tiny_policy --arch qwen2_5_vl` builds (Qwen2.5-VL's classes and layout, the
released model's two end tokens), prompted with UI-TARS-1.5's template, served by the
transformers server and by vLLM's CPU build behind its adapter (as the launcher starts
them). LoRA versions with adapters large enough to change the replies are synced to both
through their /v1/reload; after each, greedy token ids, texts, stop points and log-probs
agree across the backends, and with the trainer's."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from django.conf import settings

from core.completion import Completion
from core.encoding import encode_batch
from core.generation import sequence_logprobs
from core.policy import Policy, load_policy
from core.prompts import PROMPT_TEMPLATES, build_messages
from core.protocol import TaskSpec
from core.replies import stop_token_ids
from envmanager.sim_env import SimEnv
from hostagent.launcher import Supervisor, vllm_specs
from rollout.auth import ServiceTokens, bearer
from rollout.limits import ServingLimits
from rollout.local_server import LocalPolicyServer
from rollout.vllm_command import vllm_missing
from tests.helpers import free_port, needs, wait_until
from tests.rollout.test_vllm_cpu import _models_listed, greedy
from training.config import TrainerConfig
from training.trainer import PolicyTrainer
from workers.management.commands.make_tiny_policy import QWEN25_STAND_IN

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
ADAPTERS = 3
SCREENS = 3  # with the third adapter, the first screen's reply ends at <|endoftext|>


@pytest.fixture(scope="module")
def qwen25() -> Path:
    from training.tiny_policy import build_tiny_policy

    out = Path(settings.DARTBOARD_HOME) / "policies" / "qwen2.5-vl-tiny"  # a reload root
    return build_tiny_policy(out, seed=0, **QWEN25_STAND_IN)


@pytest.fixture(scope="module")
@needs("live")
def servers(qwen25) -> Iterator[tuple[str, str, ServiceTokens]]:
    """(vLLM's adapter URL, the transformers server's URL, their tokens)."""
    if missing := vllm_missing():
        pytest.fail(missing)
    tokens = ServiceTokens(settings.DARTBOARD_INFERENCE_TOKEN, settings.DARTBOARD_ADMIN_TOKEN)
    port = free_port()
    specs = vllm_specs(
        0,
        str(qwen25),
        port,
        tokens=tokens,
        prefix="q25-",
        limits=ServingLimits(max_prompt_tokens=3072, max_images=1),
    )
    supervisor = Supervisor(home=Path(settings.DARTBOARD_HOME), specs=specs, group="q25")
    supervisor.start()
    vllm = f"http://127.0.0.1:{port}"
    try:
        with LocalPolicyServer(qwen25, tokens=tokens) as transformers:
            wait_until(lambda: _models_listed(vllm, tokens), timeout=300, interval=1.0,
                       what="vLLM serving the Qwen2.5-VL checkpoint")  # fmt: skip
            yield vllm, transformers, tokens
    finally:
        supervisor.stop()


def prompts(n: int = SCREENS) -> list[list[dict]]:
    """UI-TARS-1.5's prompt on `n` small synthetic screens."""
    out = []
    for seed in range(n):
        task = TaskSpec(name="sim/click-3", env_kind="sim", env_config={"targets": 3}, seed=seed)
        out.append(
            build_messages(
                instruction="Click the box labelled 2.",
                history=[],
                screenshots=[SimEnv().reset(task).screenshot_png],
                template=PROMPT_TEMPLATES["ui-tars-1.5"],
            )
        )
    return out


def adapter_version(base: Path, seed: int, out: Path) -> Path:
    """A LoRA version of `base` whose B matrices are drawn at random: replies change. Seeded
    before the adapters are made (their A matrices are drawn then), so a run repeats."""
    torch.manual_seed(seed)
    trainer = PolicyTrainer(
        config=TrainerConfig(lr=1e-3, kl_coef=0.0, lora_rank=8, lora_alpha=16),
        start_checkpoint=base, run_dir=out / f"adapter-{seed}",
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.4)
    return trainer.save_version(seed + 1)


def sync(url: str, tokens: ServiceTokens, checkpoint: Path, version: int) -> None:
    r = httpx.post(f"{url}/v1/reload", json={"checkpoint": str(checkpoint), "version": version},
                   headers=bearer(tokens.admin), timeout=300)  # fmt: skip
    assert r.status_code == 200, r.text


def trainer_gaps(policy: Policy, messages: list[dict], reply: Completion) -> list[float]:
    batch = encode_batch(policy, [messages], responses=[reply.token_ids])
    with torch.no_grad():
        values, _, mask = sequence_logprobs(policy.model, batch)
    mine = values[mask.bool()].tolist()
    return [abs(a - b) for a, b in zip(mine, reply.token_logprobs, strict=True)]


def test_lora_versions_of_a_qwen25_checkpoint_reply_alike_on_both_backends(qwen25, servers):
    vllm, transformers, tokens = servers
    screens = prompts()
    stops = set(stop_token_ids(qwen25, load_policy(qwen25).tokenizer))
    before = [greedy(transformers, m, max_tokens=MAX_TOKENS) for m in screens]
    changed = ended = at_endoftext = 0
    endoftext = load_policy(qwen25).tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for seed in range(ADAPTERS):
        adapter = adapter_version(qwen25, seed, Path(settings.DARTBOARD_HOME) / "policies")
        sync(vllm, tokens, adapter, seed + 1)
        sync(transformers, tokens, adapter, seed + 1)
        policy = load_policy(adapter)  # the trainer's view of the same version
        for messages, base in zip(screens, before, strict=True):
            a = greedy(vllm, messages, max_tokens=MAX_TOKENS)
            b = greedy(transformers, messages, max_tokens=MAX_TOKENS)
            assert a.policy_version == b.policy_version == seed + 1
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert a.finish_reason == "length" or a.token_ids[-1] in stops
            gaps = [abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs, strict=True)]
            trained = trainer_gaps(policy, messages, a)
            assert statistics.mean(gaps) < 0.01 and max(gaps) < 0.05, gaps
            assert statistics.mean(trained) < 0.01 and max(trained) < 0.05, trained
            changed += a.token_ids != base.token_ids
            ended += a.finish_reason == "stop"
            at_endoftext += a.finish_reason == "stop" and a.token_ids[-1] == endoftext
    print(f"\n{ADAPTERS} adapters x {len(screens)} screens: {changed} replies changed by the "
          f"adapter, {ended} ended at a stop token {sorted(stops)} ({at_endoftext} at "
          f"<|endoftext|>), the rest at {MAX_TOKENS} tokens; equal on both backends")  # fmt: skip
    assert changed >= ADAPTERS * len(screens) // 2  # the adapters change what is compared
    assert at_endoftext >= 1  # the second end token, where the backends once parted, is met
