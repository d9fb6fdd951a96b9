"""The transformers server's side of a weight pull (`core.weight_wire`): receive a version
into a staging buffer while the worker goes on serving (`rollout.weight_pull`), checked
against this worker's model and the tag the router handed over.
`WeightReceiver.load` stages a version (pulled, or read from a checkpoint) and hands it to
the caller's `swap`, which installs it between two generation batches
(`core.policy.install_weights`):

    receiver = WeightReceiver(timeout_s=120)
    receiver.load(policy=policy, weights=source, swap=swap_between_batches, worker="host:8101")

Pulled weights are installed as views of the buffer they arrived in. The buffer the weights
before them lived in is kept and filled by the next pull (the worker's second copy of the
weights: touching fresh pages cost 0.6 s per 1.5 GB here), once nothing points into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from core.lora import is_peft_model
from core.policy import Policy, StagedWeights, stage_weights
from core.weight_wire import WeightSource, WireHeader, WireMismatch, torch_dtype
from rollout.weight_pull import PullFailed, pull_version


@dataclass(frozen=True)
class PullStats:
    bytes: int
    seconds: float


class WeightReceiver:
    """Pulls versions for one worker; `pull` is called by one reload at a time."""

    def __init__(self, *, timeout_s: float = 120.0) -> None:
        """`timeout_s`: the longest wait for the server's answer, the group, or a window."""
        self.timeout = timedelta(seconds=timeout_s)
        self._live: torch.Tensor | None = None  # the buffer the installed weights are views of
        self._spare: torch.Tensor | None = None  # a buffer nothing points into: the next staging
        self._pending: torch.Tensor | None = None  # the staged weights' buffer, until settled
        self.last = PullStats(0, 0.0)

    def load(
        self,
        *,
        policy: Policy,
        swap: Callable[[StagedWeights], object],
        checkpoint: str | None = None,
        weights: WeightSource | None = None,
        worker: str = "",
    ) -> int:
        """Stage a version beside the live weights, pulled from `weights` or read from
        `checkpoint`, and have `swap` install it (raising what the install raised); returns
        the bytes pulled. Raises what staging or `swap` raised: the live weights stay then.
        `worker` names this worker in the weight server's log."""
        if weights is not None:
            staged = self.pull(weights, policy=policy, worker=worker)
            try:
                swap(staged)
            except BaseException:
                self._settle(installed=False)
                raise
            self._settle(installed=True)
            return self.last.bytes
        assert checkpoint is not None
        self._spare = None  # a checkpoint is read whole beside the live weights: make room
        staged = stage_weights(policy, checkpoint)
        swap(staged)
        self._replaced(staged)
        return 0

    def pull(self, source: WeightSource, *, policy: Policy, worker: str) -> StagedWeights:
        """Receive `source`'s version and return it staged for `policy`'s model (the model is
        only read). Raises what `rollout.weight_pull.pull_version` raises (WireUnreachable,
        WireMismatch when the version does not fit this model, WireError); nothing is
        staged then."""
        live: dict[str, torch.Tensor] = {}
        try:
            pulled = pull_version(
                source,
                worker=worker,
                timeout=self.timeout,
                fits=lambda header: live.update(_targets(policy, header)),
                buffer_for=self._staging,
            )
        except PullFailed as exc:
            self._spare = exc.buffer  # filled halfway or refused: reused, never installed
            raise
        header, buffer = pulled.header, pulled.buffer
        tensors, shared = {}, False
        for entry in header.tensors:
            target, view = live[entry.name], entry.view(buffer)
            if view.dtype == target.dtype and target.device.type == "cpu":
                tensors[entry.name], shared = view, True
            else:  # cast (from float32: as from_pretrained casts a checkpoint) or moved
                tensors[entry.name] = view.to(device=target.device, dtype=target.dtype)
        if shared:  # the staged weights live in the buffer
            self._pending = buffer
        else:
            self._spare = buffer
        self.last = PullStats(header.total_bytes, pulled.seconds)
        return StagedWeights(
            header.kind, tensors, f"version {source.version} from {source.address}"
        )

    def _settle(self, *, installed: bool) -> None:
        """After the install of what `pull` returned: when `installed`, its buffer is live and
        the one before it free; otherwise its buffer is free."""
        pending, self._pending = self._pending, None
        if not installed:
            if pending is not None:
                self._spare = pending
            return
        if self._live is not None:  # the weights before lived there: nothing does now
            self._spare = self._live
        self._live = pending

    def _replaced(self, staged: StagedWeights) -> None:
        """`staged`, read from a checkpoint, was installed: full weights replace every
        tensor, so the live buffer is free; an adapter directory is copied into the live
        adapter's tensors, which stay where they are."""
        if staged.adapter_dir is None and self._live is not None:
            self._spare, self._live = self._live, None

    def _staging(self, total_bytes: int) -> torch.Tensor:
        spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == total_bytes:
            return spare
        return torch.empty(total_bytes, dtype=torch.uint8)


def _targets(policy: Policy, header: WireHeader) -> dict[str, torch.Tensor]:
    """The live parameters `header`'s tensors replace, checked against it: the same names
    and shapes, and a dtype that gives what the checkpoint gives (the served one, or float32
    cast down as from_pretrained casts it). Raises WireMismatch."""
    model = policy.model
    if header.kind == "full" and is_peft_model(model):
        raise WireMismatch("this worker serves a LoRA adapter: full weights come by checkpoint")
    if header.kind == "adapter" and not is_peft_model(model):
        raise WireMismatch("this worker holds no adapter yet: the first one comes by checkpoint")
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    if header.kind == "adapter":
        params = {n: p for n, p in params.items() if "lora_" in n}
    names = {e.name for e in header.tensors}
    if names != set(params):
        missing, unexpected = sorted(set(params) - names), sorted(names - set(params))
        raise WireMismatch(
            f"the weight server's tensors are not this model's (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    for entry in header.tensors:
        live = params[entry.name]
        if tuple(live.shape) != entry.shape:
            raise WireMismatch(
                f"{entry.name} is {list(entry.shape)} on the wire, {list(live.shape)} here"
            )
        wire = torch_dtype(entry.dtype)
        if wire != live.dtype and wire != torch.float32:
            raise WireMismatch(
                f"{entry.name} comes as {wire} but this worker serves {live.dtype}: the "
                "checkpoint would give other weights (publish in the served dtype)"
            )
    return params
