"""Weights pulled from the trainer's weight server straight into vLLM's engine: a worker
extension vLLM mixes into its worker class (`vllm serve --worker-extension-cls
rollout.vllm_weights.WeightPullExtension`, in `rollout.vllm_command`'s arguments), whose
methods the adapter (`rollout.vllm_adapter`) calls through vLLM's dev-mode /collective_rpc.
It runs in vLLM's process and environment, so it imports torch, safetensors and
`rollout.weight_pull` only.

- **full weights** are pulled into a staging buffer (kept for the next pull) and handed to
  vLLM's own in-place reload (`Worker.reload_weights(weights_iterator=...)`: checkpoint names
  mapped through the LoRA layers `--enable-lora` wraps around the base weights, the
  worker's LoRA, encoder and multimodal caches reset). What arrives is first checked
  against the served checkpoint's tensor names and shapes (read from its safetensors
  headers, no weights), so a version that does not fit is refused before vLLM's weights
  are touched.
- **LoRA adapters** are pulled (megabytes) and written as an adapter directory beside the
  serving adapter's config, in memory (a directory of this process's own under /dev/shm
  where it exists), for vLLM's /v1/load_lora_adapter: vLLM loads adapters from a
  directory only. The two newest are kept (the serving adapter and the one replacing it);
  the directories of vLLM processes that are gone are removed when the next one is made.

Each method answers a dict (what /collective_rpc can return): what was pulled, or
{"error", "unreachable", "mismatch"} for a pull that failed, with vLLM's weights untouched.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.weight_wire import (
    WeightSource,
    WireError,
    WireHeader,
    WireMismatch,
    WireUnreachable,
    torch_dtype,
)
from rollout.weight_pull import Pulled, PullFailed, pull_version

ADAPTER_NAME = "default"  # the trainer's PEFT adapter, named in its parameters, not its files
KEPT_ADAPTER_DIRS = 2


class WeightPullExtension:
    """Mixed into vLLM's worker (`self` is the worker: `model_config`, `reload_weights`)."""

    _dartboard_spare: torch.Tensor | None = None  # a staging buffer nothing points into
    _dartboard_adapters: Path | None = None  # this process's pulled adapter directories

    def dartboard_pulls(self) -> dict[str, Any]:
        """Whether this vLLM was started with the extension (the adapter asks once; vLLM's
        /collective_rpc passes dicts through and turns other results into strings)."""
        return {"pulls": True}

    def dartboard_pull_full(
        self, weights: dict[str, Any], version: int, worker: str, timeout_s: float
    ) -> dict[str, Any]:
        """Pull `version`'s full weights and load them in place. The caller has drained
        vLLM (no request in flight) and resets the scheduler's caches after."""
        source = WeightSource.from_json(weights, version=version)
        served = Path(self.model_config.model)  # type: ignore[attr-defined]
        served_dtype = self.model_config.dtype  # type: ignore[attr-defined]
        pulled, failure = self._dartboard_pull(
            source,
            worker=worker,
            timeout_s=timeout_s,
            fits=lambda header: _fits_checkpoint(header, served, served_dtype),
        )
        if pulled is None:
            return failure
        tensors = [(e.name, e.view(pulled.buffer)) for e in pulled.header.tensors]
        self.reload_weights(weights_iterator=iter(tensors))  # type: ignore[attr-defined]
        self._dartboard_spare = pulled.buffer  # copied into vLLM's weights: free again
        return {"bytes": pulled.header.total_bytes, "seconds": pulled.seconds}

    def dartboard_pull_adapter(
        self, weights: dict[str, Any], version: int, worker: str, timeout_s: float, like: str
    ) -> dict[str, Any]:
        """Pull `version`'s LoRA adapter and write it as an adapter directory with the
        config of `like` (the serving adapter's directory); returns its path."""
        source = WeightSource.from_json(weights, version=version)
        pulled, failure = self._dartboard_pull(
            source,
            worker=worker,
            timeout_s=timeout_s,
            fits=lambda header: _fits_adapter(header, Path(like)),
        )
        if pulled is None:
            return failure
        if self._dartboard_adapters is None:  # this process's own directory
            parent = _memory_dir()
            _forget_dead_processes_dirs(Path(parent or tempfile.gettempdir()))
            self._dartboard_adapters = Path(
                tempfile.mkdtemp(prefix=f"dartboard-lora-{os.getpid()}-", dir=parent)
            )
            atexit.register(shutil.rmtree, self._dartboard_adapters, True)  # memory, not disk
        path = self._dartboard_adapters / f"v{version}"
        shutil.rmtree(path, ignore_errors=True)  # a version pulled again
        path.mkdir()
        shutil.copy(Path(like) / "adapter_config.json", path / "adapter_config.json")
        tensors = {_saved_name(e.name): e.view(pulled.buffer) for e in pulled.header.tensors}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        self._dartboard_spare = pulled.buffer
        _forget_old_adapter_dirs(self._dartboard_adapters, keep=path)
        return {"bytes": pulled.header.total_bytes, "seconds": pulled.seconds, "path": str(path)}

    def _dartboard_pull(
        self, source: WeightSource, *, worker: str, timeout_s: float, fits: Any
    ) -> tuple[Pulled | None, dict[str, Any]]:
        spare, self._dartboard_spare = self._dartboard_spare, None

        def buffer_for(total_bytes: int) -> torch.Tensor:
            if spare is not None and spare.numel() == total_bytes:
                return spare
            return torch.empty(total_bytes, dtype=torch.uint8)

        try:
            pulled = pull_version(
                source,
                worker=worker,
                timeout=timedelta(seconds=timeout_s),
                fits=fits,
                buffer_for=buffer_for,
            )
        except WireError as exc:
            if isinstance(exc, PullFailed):
                self._dartboard_spare = exc.buffer
            return None, {
                "error": str(exc),
                "unreachable": isinstance(exc, WireUnreachable),
                "mismatch": isinstance(exc, WireMismatch),
            }
        return pulled, {}


def _fits_checkpoint(header: WireHeader, served: Path, served_dtype: torch.dtype) -> None:
    """Every tensor on the wire is one of the served checkpoint's, with its shape, in the
    served dtype or float32 (cast down as vLLM casts a checkpoint). Raises WireMismatch."""
    if header.kind != "full":
        raise WireMismatch("this worker serves the base model: an adapter comes by checkpoint")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(glob.glob(str(served / "*.safetensors"))):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118  # a safetensors handle, not a dict
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    if not shapes:
        raise WireMismatch(f"the served checkpoint {served} has no safetensors to check against")
    unknown = [e.name for e in header.tensors if e.name not in shapes]
    if unknown:
        raise WireMismatch(f"the weight server's tensors are not this model's ({unknown[:3]})")
    for entry in header.tensors:
        if shapes[entry.name] != entry.shape:
            raise WireMismatch(
                f"{entry.name} is {list(entry.shape)} on the wire, {list(shapes[entry.name])} here"
            )
        wire = torch_dtype(entry.dtype)
        if wire not in (served_dtype, torch.float32):
            raise WireMismatch(
                f"{entry.name} comes as {wire} but this worker serves {served_dtype}"
            )


def _fits_adapter(header: WireHeader, like: Path) -> None:
    """The tensors on the wire are the serving adapter's, by name (as saved) and shape."""
    if header.kind != "adapter":
        raise WireMismatch("this worker serves a LoRA adapter: full weights come by checkpoint")
    files = (like / "adapter_config.json", like / "adapter_model.safetensors")
    if not all(f.is_file() for f in files):
        raise WireMismatch("this worker holds no adapter yet: the first one comes by checkpoint")
    json.loads(files[0].read_text())  # a config vLLM will read: fail here, not there
    with safe_open(str(files[1]), "pt") as handle:
        shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in handle.keys()}  # noqa: SIM118
    wire = {_saved_name(e.name): e.shape for e in header.tensors}
    if wire != shapes:
        differ = sorted(set(wire) ^ set(shapes)) or [n for n in wire if wire[n] != shapes[n]]
        raise WireMismatch(f"the adapter on the wire is not this worker's ({differ[:3]})")


def _saved_name(name: str) -> str:
    """A PEFT parameter's name as its adapter file names it (PEFT drops the adapter's name)."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def _memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def _forget_dead_processes_dirs(parent: Path) -> None:
    """Remove the adapter directories of vLLM processes that are gone (vLLM ends its workers
    without running their exit handlers, so a directory can outlive its process)."""
    for stale in parent.glob("dartboard-lora-*-*"):
        pid = stale.name.split("-")[2]
        mine = stale.stat().st_uid == os.getuid()
        if mine and pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(stale, ignore_errors=True)


def _forget_old_adapter_dirs(parent: Path, *, keep: Path) -> None:
    """Remove the pulled adapter directories in `parent` but the KEPT_ADAPTER_DIRS newest."""
    pulled = sorted(parent.iterdir(), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for old in pulled[KEPT_ADAPTER_DIRS:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
