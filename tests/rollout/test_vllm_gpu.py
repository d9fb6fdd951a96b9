"""vLLM behind the adapter, started exactly as the launcher starts it (a unix socket in a
0700 directory, its key in VLLM_API_KEY), on the tiny policy: completions through the official client, a LoRA adapter switch and a full-weight
reload with requests in flight (none may fail, and afterwards the served log-probs are the
new weights'). Needs a CUDA GPU and vLLM (requirements-gpu.txt); skipped otherwise, so CI
never runs it."""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from core.lora import LoraSpec
from rollout.auth import ADMIN_ENV, VLLM_KEY_ENV, client_token
from rollout.vllm_command import vllm_environment, vllm_serve_args
from tests.helpers import needs
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
@needs("gpu")
def adapter_url(tiny_policy_dir) -> Iterator[str]:
    adapter_port, key = free_port(), secrets.token_urlsafe(32)
    sock = Path(tempfile.mkdtemp(prefix="dartboard-vllm-")) / "vllm.sock"  # mkdtemp: 0700
    args = vllm_serve_args(model_dir=str(tiny_policy_dir), uds=str(sock))  # the launcher's
    vllm = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
        cwd=ROOT,
        env={**os.environ, **vllm_environment(api_key=key), "PYTHONPATH": str(ROOT)},
    )
    try:
        wait_until(lambda: vllm.poll() is None and _up(sock), timeout=600, what="vLLM up")
        adapter = start_process(
            ["rollout.vllm_adapter", "--vllm", f"unix:{sock}",
             "--policy-dir", str(tiny_policy_dir), "--port", str(adapter_port),
             "--checkpoint-root", str(tiny_policy_dir.parent)],
            health_url=f"http://127.0.0.1:{adapter_port}/health",
            env={VLLM_KEY_ENV: key},
        )  # fmt: skip
        yield f"http://127.0.0.1:{adapter_port}"
        stop_process(adapter)
    finally:
        stop_process(vllm)


def _up(sock: Path) -> bool:
    import httpx

    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))) as http:
            return http.get("http://vllm/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_adapter_switch_and_full_reload_under_load(adapter_url, tiny_policy_dir) -> None:
    import httpx

    auth = {"Authorization": f"Bearer {client_token(None, ADMIN_ENV)}"}  # reloads: admin
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
