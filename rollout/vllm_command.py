"""How Dartboard starts vLLM: the one argument list the launcher runs (`rollout.backend =
"vllm"`), the vLLM tests run, and docker-compose.yml's `vllm` service and the docs spell out
(`tests/test_layout.py` checks that they agree).

- vLLM runs from its own environment (`.venv-vllm`, built by `make vllm-env` from
  requirements-vllm-cpu.txt on CPU machines; on GPU hosts from requirements-gpu.txt), never
  the project's: its pins are not the project's. `DARTBOARD_VLLM_PYTHON` names another one.
- dev mode: /collective_rpc runs vLLM's own in-place `reload_weights` (full weights, LoRA
  layers included), and /reset_prefix_cache and /reset_mm_cache are served;
- weights pulled from the trainer's weight server into vLLM's engine: the worker extension
  `rollout.vllm_weights.WeightPullExtension` (`--worker-extension-cls`), imported from this
  checkout (PYTHONPATH) inside vLLM's own environment;
- runtime LoRA updating: /v1/load_lora_adapter (adapter sync), two adapters side by side
  (`--max-loras 2`: the new version loads while the old one finishes its requests);
- sampling: vLLM's neutral defaults, never the checkpoint's `generation_config.json`
  (`--generation-config vllm`: Qwen2.5-VL-7B-Instruct's ships top_k=1 and
  repetition_penalty=1.05, which make every rollout of a group the same and sample from a
  distribution other than the one whose log-probs are recorded); log-probs are the model's
  raw ones (`--logprobs-mode raw_logprobs`), as the trainer computes them;
- the served name is "policy" (what Dartboard's client asks for); per-token log-probs with up
  to 20 alternatives.
- the API key is never an argument (a command line is visible to every local user in `ps`
  and in the launcher's run/children.json): vLLM reads VLLM_API_KEY from its environment.
  It guards /v1/* only, not the dev-mode routes, so vLLM listens where only its adapter can
  connect: a unix socket (`--uds`) in a 0700 directory (the launcher), or a network only the
  adapter joins (compose).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rollout.auth import VLLM_KEY_ENV
from rollout.limits import ServingLimits

ROOT = Path(__file__).resolve().parents[1]
VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
VLLM_PYTHON_ENV = "DARTBOARD_VLLM_PYTHON"
WORKER_EXTENSION = "rollout.vllm_weights.WeightPullExtension"


def vllm_serve_args(
    *,
    model_dir: str,
    host: str | None = None,
    port: int | None = None,
    uds: str | None = None,
    gpu_memory: float | None = None,
    dtype: str = "auto",
    limits: ServingLimits | None = None,
    cpu_build: bool = False,
    pull_weights: bool = True,
) -> list[str]:
    """`vllm serve`'s arguments (after the program) for the policy in `model_dir`, listening
    on `uds` (a unix socket path) or on host:port; `gpu_memory`: the fraction of its GPU it
    takes (vLLM's default 0.9 when None); `dtype`: the weights' (`checkpoint_dtype`).
    `limits`: the run's budgets (`ServingLimits.for_run`: its prompt plus reply tokens, the
    screenshots kept, its LoRA rank): without them vLLM sizes its cache for the model's whole
    context (128k tokens for Qwen2.5-VL) and its own default image count, and serves
    adapters up to the shared workers' rank. `cpu_build`: vLLM's CPU build (`vllm_cpu_build`)
    takes each prompt in one prefill: it cannot split a seeded request's (vLLM 0.32 rewinds
    the request's generator after a partial prefill, which a CPU generator refuses, "CPU
    Generator does not use offset", and its engine dies), and its default prefill chunk is
    2,048 tokens, less than one full-HD screenshot of UI-TARS-1.5's. `pull_weights`: load
    the worker extension that takes versions from the trainer's weight server
    (`WORKER_EXTENSION`; it needs this checkout on vLLM's path, `vllm_environment`), where
    vLLM can reach that server."""
    if (uds is None) == (host is None or port is None):
        raise ValueError("vLLM listens on a unix socket (uds) or on host and port, not both")
    listen = ["--uds", uds] if uds is not None else ["--host", str(host), "--port", str(port)]
    # Laid out by hand: each flag beside its values, as on the command line.
    return [
        "--model", model_dir, "--served-model-name", "policy",
        *listen,
        "--max-logprobs", "20", "--logprobs-mode", "raw_logprobs",
        "--generation-config", "vllm", "--dtype", dtype,
        "--enable-lora", "--max-lora-rank", str((limits or ServingLimits()).max_lora_rank),
        "--max-loras", "2",
        *(["--worker-extension-cls", WORKER_EXTENSION] if pull_weights else []),
        *(["--gpu-memory-utilization", str(gpu_memory)] if gpu_memory is not None else []),
        *(["--max-model-len", str(limits.max_model_len),
           "--limit-mm-per-prompt", json.dumps({"image": limits.max_images})]
          if limits is not None else []),
        *(["--no-enable-chunked-prefill"] if cpu_build else []),
    ]  # fmt: skip


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype a checkpoint directory's config names, for vLLM's --dtype: its "auto" turns
    float32 into bfloat16 (on CPUs too), so the tiny policy would be served in bf16 while the
    trainer scores in fp32. "auto" where the config names none or is not on this disk."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    named = config.get("dtype") or config.get("torch_dtype") or "auto"
    return named if named in ("float32", "bfloat16", "float16") else "auto"


def vllm_gpus(*, workers: int, placement: str, trainer_replicas: int) -> list[int]:
    """The GPU of each vLLM worker on one host: after the trainer's (its replica r holds GPU
    r), or on the trainer's own (`shared`, which run validation allows only with a memory
    split: `RunConfig`)."""
    first = 0 if placement == "shared" else trainer_replicas
    return [first + i for i in range(workers)]


def vllm_environment(*, api_key: str, cpu_build: bool = False) -> dict[str, str]:
    """The variables vLLM needs from Dartboard: dev mode, runtime LoRA, its API key, and
    this checkout on its path (the worker extension, `WORKER_EXTENSION`).

    On its CPU build (`cpu_build`, `vllm_cpu_build`) also `TORCHDYNAMO_DISABLE`: that build
    compiles its sampler's log-prob helper with torch's inductor (C++ through g++, in child
    processes) at the first request that asks for log-probs, after every start, and every
    Dartboard request asks for them. Eager, that first request is answered at once and later
    ones as fast (docs/benchmarks.md, *vLLM's first request on a CPU*). GPU builds keep their
    compilation (their CUDA graphs depend on it)."""
    return {
        **VLLM_ENV,
        VLLM_KEY_ENV: api_key,
        "PYTHONPATH": str(ROOT),
        **({"TORCHDYNAMO_DISABLE": "1"} if cpu_build else {}),
    }


def vllm_cpu_build(python: Path | None = None) -> bool:
    """Whether vLLM's environment (the one `python`, default `vllm_python()`, runs in) holds
    vLLM's CPU build: its `vllm-cpu` distribution."""
    venv = (python or vllm_python()).parent.parent
    return any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))


def vllm_python() -> Path:
    """The interpreter of vLLM's own environment."""
    named = os.environ.get(VLLM_PYTHON_ENV, "")
    return Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None when it can."""
    python = vllm_python()
    if not python.exists():
        return (
            f"rollout.backend is vllm but vLLM's environment {python} does not exist: "
            "`make vllm-env` builds it (the CPU build, ~3.5 GB); on a GPU host install "
            f"requirements-gpu.txt into a virtual environment and set {VLLM_PYTHON_ENV} "
            "to its python"
        )
    return None
