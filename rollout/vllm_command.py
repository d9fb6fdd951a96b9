"""How Dartboard starts vLLM: the one argument list the launcher runs (`rollout.backend =
"vllm"`), the GPU test runs, and docker-compose.yml's `vllm` service and the README spell
out (`tests/test_layout.py` checks that they agree).

- dev mode: /collective_rpc reloads full weights in place (`rollout.vllm_ext`), and
  /reset_prefix_cache and /reset_mm_cache are served;
- runtime LoRA updating: /v1/load_lora_adapter (adapter sync);
- the served name is "policy" (what Dartboard's client asks for); the API key is the
  service token; per-token log-probs with up to 20 alternatives.
"""

from __future__ import annotations

import importlib.util

VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
MAX_LORA_RANK = 64


def vllm_serve_args(*, model_dir: str, host: str, port: int, token: str) -> list[str]:
    """`vllm serve`'s arguments (after the program) for the policy in `model_dir`."""
    return [
        "--model", model_dir, "--served-model-name", "policy",
        "--host", host, "--port", str(port),
        "--max-logprobs", "20",
        "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK),
        "--api-key", token,
        "--worker-extension-cls", "rollout.vllm_ext.ReloadFromDisk",
    ]  # fmt: skip


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "rollout.backend is vllm but vLLM is not installed in this environment (on a GPU "
            "host: pip install -r requirements-gpu.txt, in its own virtual environment)"
        )
    return None
