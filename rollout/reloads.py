"""What POST /v1/reload asks of an inference worker, checked the same way by the transformers
server and the vLLM adapter: a version and one source, a checkpoint (a directory under the
checkpoint roots, or an artifact reference fetched and verified from the store) or the
trainer's weight server (`core.weight_wire.WeightSource`: pulled over torch.distributed by a
worker that can, `rollout.weight_receive`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from core.artifacts import ArtifactError
from core.lora import is_adapter_dir
from core.weight_wire import WeightSource, WireError
from rollout.asgi import RequestError
from rollout.checkpoints import CheckpointSource, fetch_failure_status


@dataclass(frozen=True)
class ReloadRequest:
    """A checked POST /v1/reload body: a version and exactly one of its sources."""

    version: int
    checkpoint: str | None  # under a checkpoint root, or an artifact reference
    weights: WeightSource | None  # the trainer's weight server


def reload_request(body: dict[str, Any], source: CheckpointSource) -> ReloadRequest:
    """Raise RequestError naming the bad field."""
    checkpoint, version, weights = body.get("checkpoint"), body.get("version"), body.get("weights")
    if weights is not None and checkpoint is not None:
        raise RequestError("name a checkpoint or weights, not both", param="weights")
    if weights is None and (not isinstance(checkpoint, str) or not checkpoint):
        raise RequestError("checkpoint must be a directory path string", param="checkpoint")
    if not isinstance(version, int) or isinstance(version, bool):
        raise RequestError("version must be an integer", param="version")
    if weights is not None:
        try:
            return ReloadRequest(version, None, WeightSource.from_json(weights, version=version))
        except WireError as exc:
            raise RequestError(str(exc), param="weights") from None
    assert isinstance(checkpoint, str)
    source.check(checkpoint)
    return ReloadRequest(version, checkpoint, None)


class ReloadRefused(Exception):
    """A checkpoint a reload cannot load, with the HTTP status and field to answer."""

    def __init__(self, status: int, message: str, *, param: str) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def local_checkpoint(request: ReloadRequest, source: CheckpointSource, *, kept: str) -> str:
    """The local directory of a reload's checkpoint, fetched from the store when a reference
    (blocking: gigabytes); raises ReloadRefused with the status and message to answer,
    which `kept` ("kept version 3") ends."""
    assert request.checkpoint is not None
    try:
        local = source.local(request.checkpoint)
    except ArtifactError as exc:
        message = f"checkpoint not loaded, {kept}: {exc}"
        raise ReloadRefused(fetch_failure_status(exc), message, param="checkpoint") from None
    if not is_adapter_dir(local) and not os.path.isfile(os.path.join(local, "config.json")):
        raise ReloadRefused(
            400,
            f"checkpoint {local} is neither a model directory (config.json) nor a LoRA "
            "adapter (adapter_config.json)",
            param="checkpoint",
        )
    return local
