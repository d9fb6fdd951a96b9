"""vLLM behind the adapter, started exactly as docker-compose.yml starts it, on the tiny
policy: completions through the official client, a LoRA adapter switch and a full-weight
reload with requests in flight (none may fail, and afterwards the served log-probs are the
new weights'). Needs a CUDA GPU and vLLM (requirements-gpu.txt); skipped otherwise, so CI
never runs it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from core.lora import LoraSpec
from rollout.auth import client_token
from rollout.vllm_command import VLLM_ENV, vllm_serve_args
from tests.rollout.test_router import (
    ROOT,
    ClientLoops,
    free_port,
    start_process,
    stop_process,
    wait_until,
)
from training.trainer import PolicyTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
        reason="needs a CUDA GPU and vLLM",
    ),
]


@pytest.fixture(scope="module")
def adapter_url(tiny_policy_dir) -> Iterator[str]:
    vllm_port, adapter_port = free_port(), free_port()
    args = vllm_serve_args(  # what the launcher runs, and compose and the README spell out
        model_dir=str(tiny_policy_dir), host="127.0.0.1", port=vllm_port, token=client_token(None)
    )
    vllm = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
        cwd=ROOT,
        env={**os.environ, **VLLM_ENV, "PYTHONPATH": str(ROOT)},
    )
    try:
        wait_until(
            lambda: vllm.poll() is None and _up(f"http://127.0.0.1:{vllm_port}/health"),
            timeout=600,
            what="vLLM up",
        )
        adapter = start_process(
            ["rollout.vllm_adapter", "--vllm", f"http://127.0.0.1:{vllm_port}",
             "--policy-dir", str(tiny_policy_dir), "--port", str(adapter_port),
             "--checkpoint-root", str(tiny_policy_dir.parent)],
            health_url=f"http://127.0.0.1:{adapter_port}/health",
        )  # fmt: skip
        yield f"http://127.0.0.1:{adapter_port}"
        stop_process(adapter)
    finally:
        stop_process(vllm)


def _up(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_adapter_switch_and_full_reload_under_load(adapter_url, tiny_policy_dir) -> None:
    import httpx

    auth = {"Authorization": f"Bearer {client_token(None)}"}
    trainer = PolicyTrainer(
        start_checkpoint=tiny_policy_dir,
        run_dir=tiny_policy_dir.parent / "gpu-run",
        lr=1e-3,
        kl_coef=0,
        lora=LoraSpec(rank=8, alpha=16),
    )
    with torch.no_grad():
        for name, p in trainer.policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    adapter_dir = trainer.save_version(1)
    with ClientLoops(adapter_url, n=8) as loops:
        wait_until(lambda: loops.each_has(1), what="first answers", timeout=120)
        for checkpoint, version in ((adapter_dir, 1), (tiny_policy_dir, 2)):  # LoRA, then full
            r = httpx.post(
                f"{adapter_url}/v1/reload",
                json={"checkpoint": str(checkpoint), "version": version},
                headers=auth,
                timeout=600,
            )
            assert r.status_code == 200, r.text
        wait_until(lambda: loops.each_has(2), what="answers after the reloads", timeout=120)
    assert loops.errors == []
    assert {c.completion.policy_version for c in loops.all()} >= {0, 1, 2}
