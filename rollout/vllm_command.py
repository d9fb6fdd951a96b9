"""How Dartboard starts vLLM: the one argument list the launcher runs (`rollout.backend =
"vllm"`), the GPU test runs, and docker-compose.yml's `vllm` service and the README spell
out (`tests/test_layout.py` checks that they agree).

- dev mode: /collective_rpc reloads full weights in place (`rollout.vllm_ext`), and
  /reset_prefix_cache and /reset_mm_cache are served;
- runtime LoRA updating: /v1/load_lora_adapter (adapter sync);
- the served name is "policy" (what Dartboard's client asks for); per-token log-probs with up
  to 20 alternatives.
- the API key is never an argument (a command line is visible to every local user in `ps`
  and in the launcher's run/children.json): vLLM reads VLLM_API_KEY from its environment.
  It guards /v1/* only, not the dev-mode routes, so vLLM listens where only its adapter can
  connect: a unix socket (`--uds`) in a 0700 directory (the launcher), or a network only the
  adapter joins (compose).
"""

from __future__ import annotations

import importlib.util

from rollout.auth import VLLM_KEY_ENV

VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
MAX_LORA_RANK = 64


def vllm_serve_args(
    *, model_dir: str, host: str | None = None, port: int | None = None, uds: str | None = None
) -> list[str]:
    """`vllm serve`'s arguments (after the program) for the policy in `model_dir`, listening
    on `uds` (a unix socket path) or on host:port."""
    if (uds is None) == (host is None or port is None):
        raise ValueError("vLLM listens on a unix socket (uds) or on host and port, not both")
    listen = ["--uds", uds] if uds is not None else ["--host", str(host), "--port", str(port)]
    return [
        "--model", model_dir, "--served-model-name", "policy",
        *listen,
        "--max-logprobs", "20",
        "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK),
        "--worker-extension-cls", "rollout.vllm_ext.ReloadFromDisk",
    ]  # fmt: skip


def vllm_environment(*, api_key: str) -> dict[str, str]:
    """The variables vLLM needs from Dartboard: dev mode, runtime LoRA, and its API key."""
    return {**VLLM_ENV, VLLM_KEY_ENV: api_key}


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "rollout.backend is vllm but vLLM is not installed in this environment (on a GPU "
            "host: pip install -r requirements-gpu.txt, in its own virtual environment)"
        )
    return None
