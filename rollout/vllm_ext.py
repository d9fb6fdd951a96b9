"""A vLLM worker extension that reloads weights from a checkpoint directory in place.

Loaded into vLLM's workers with `--worker-extension-cls rollout.vllm_ext.ReloadFromDisk`
and called through vLLM's dev-mode `POST /collective_rpc {"method": "reload_from_disk",
"args": [path]}` (VLLM_SERVER_DEV_MODE=1) by `rollout.vllm_adapter`. The checkpoint is a
normal HF directory written by the trainer (`training.trainer.PolicyTrainer.save_version`),
so the model architecture is unchanged and only tensors are copied: seconds, not the ~5
minute process restart of DART's release.
This module imports nothing from vLLM at import time; it runs only on GPU hosts.
"""

from __future__ import annotations

from pathlib import Path


class ReloadFromDisk:
    """Mixed into vLLM's GPU worker class; `self.model_runner` is the worker's runner."""

    def reload_from_disk(self, path: str) -> int:
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors under {path}")
        model = self.model_runner.model  # type: ignore[attr-defined]
        loaded = 0
        for file in files:
            weights = load_file(str(file), device="cpu")
            model.load_weights(weights=weights.items())
            loaded += len(weights)
        return loaded
