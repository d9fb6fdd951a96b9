"""LoRA adapter sync through the router: two inference workers serving the base swap in an
adapter version (megabytes, in place), one worker at a time, under load; no request fails,
and what they serve afterwards is exactly the adapter's policy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from core.encoding import encode_prompt_response
from core.generation import sequence_logprobs
from core.lora import is_adapter_dir
from core.policy import load_policy
from rollout.client import PolicyClient, RouterAdmin
from tests.helpers import wait_until
from tests.rollout.test_router import MESSAGES, ClientLoops
from training.config import TrainerConfig
from training.trainer import PolicyTrainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory) -> list[Path]:
    """Two adapter versions over the cluster's base (v0), with clearly non-zero weights."""
    run_dir = checkpoints[0].parent / "lora-run"  # under the workers' checkpoint root
    torch.manual_seed(0)
    trainer = PolicyTrainer(
        config=TrainerConfig(lr=1e-3, kl_coef=0.0, lora_rank=4, lora_alpha=8),
        start_checkpoint=checkpoints[0],
        run_dir=run_dir,
    )
    published = []
    for version in (1, 2):
        with torch.no_grad():
            for name, p in trainer.policy.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.5)
        published.append(trainer.save_version(version))
    return published


def served_logprobs_match(url: str, checkpoint: Path) -> float:
    """Largest gap between the served token log-probs and `checkpoint`'s own."""
    with PolicyClient(url, timeout=60) as client:
        completion = client.complete(MESSAGES, max_tokens=6, temperature=1.0, seed=3)
    policy = load_policy(checkpoint)
    batch, mask = encode_prompt_response(policy, MESSAGES, token_ids=completion.token_ids)
    with torch.no_grad():
        values, _, _ = sequence_logprobs(policy, batch)
    local = values[mask].tolist()
    return max(abs(a - b) for a, b in zip(local, completion.token_logprobs, strict=True))


def test_adapter_versions_sync_in_place_under_load(cluster, checkpoints, adapters) -> None:
    assert all(is_adapter_dir(a) for a in adapters)
    admin = RouterAdmin(cluster.router)
    assert served_logprobs_match(cluster.router, checkpoints[0]) < 1e-4
    with ClientLoops(cluster.router, n=4) as loops:
        wait_until(lambda: loops.each_has(1), what="first answers")
        for version, adapter in enumerate(adapters, start=1):
            admin.sync(str(adapter), version)
            admin.wait_for_version(version, timeout=90)
            t_done = time.monotonic()
            wait_until(lambda t=t_done: loops.each_has(1, after=t), what="answers after sync")
    assert loops.errors == []
    assert {c.completion.policy_version for c in loops.all()} == {0, 1, 2}
    # The workers now serve the second adapter on the base, not the base and not the first.
    for url in cluster.workers:
        assert served_logprobs_match(url, adapters[1]) < 1e-4
        assert served_logprobs_match(url, checkpoints[0]) > 1e-2
    events = admin.health()
    assert all(w["policy_version"] == 2 for w in events["workers"])
    admin.close()
