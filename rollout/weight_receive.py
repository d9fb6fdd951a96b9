"""An inference worker's side of a weight pull (`core.weight_wire`): ask the trainer's weight
server for a version, receive its buffer over a two-rank gloo group into a staging buffer
while the worker goes on serving, and check it against the tag the router handed over.
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

import json
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.lora import is_peft_model
from core.policy import Policy, StagedWeights, stage_weights
from core.weight_wire import (
    CONNECT_S,
    READY,
    REQUESTS,
    PullRequest,
    VersionTagger,
    WeightSource,
    WireError,
    WireHeader,
    WireMismatch,
    WireUnreachable,
    answer_key,
    done_key,
    pull_group,
    pull_proof,
    ready_key,
    tags_equal,
    torch_dtype,
)


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
        only read). Raises WireUnreachable when the server takes no connection, WireMismatch
        when the version does not fit this model, WireError for anything else (the server
        refused, did not answer, died, or the bytes do not give the version's tag); nothing
        is staged then."""
        started = time.monotonic()
        _connect_once(source)
        try:
            store = dist.TCPStore(source.host, source.port, None, False, self.timeout)
        except Exception as exc:  # c10d raises its own error classes
            raise WireError(
                f"the weight server at {source.address} did not answer: {exc}"
            ) from None
        pull_id = secrets.token_hex(16)
        proof = pull_proof(source.key, source.version, pull_id)
        store.queue_push(REQUESTS, PullRequest(pull_id, source.version, proof, worker).encode())
        header_bytes = self._answer(store, source, pull_id)
        try:
            header = WireHeader.decode(header_bytes)
            live = _targets(policy, header)
        except WireError as exc:
            _tell(store, ready_key(pull_id), f"refused: {exc}")
            raise
        _tell(store, ready_key(pull_id), READY)
        buffer = self._staging(header.total_bytes)
        try:
            group = _group(store, source=source, pull_id=pull_id, timeout=self.timeout)
            tag = _receive(group, header, header_bytes, buffer, key=source.key)
        except Exception as exc:
            self._spare = buffer  # filled halfway: reused, never installed
            _tell(store, done_key(pull_id), f"failed: {exc}")
            raise WireError(
                f"the pull of version {source.version} from {source.address} broke off: "
                f"{type(exc).__name__}: {str(exc)[:300]}"
            ) from None
        if not tags_equal(tag, source.tag):
            self._spare = buffer
            _tell(store, done_key(pull_id), "refused: tag mismatch")
            raise WireError(
                f"version {source.version} from {source.address} gives the tag {tag}, but the "
                f"trainer published {source.tag}: not installed"
            )
        _tell(store, done_key(pull_id), "verified")
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
        self.last = PullStats(header.total_bytes, time.monotonic() - started)
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

    def _answer(self, store: dist.TCPStore, source: WeightSource, pull_id: str) -> bytes:
        try:
            store.wait([answer_key(pull_id)], self.timeout)
            answer = json.loads(store.get(answer_key(pull_id)))
        except Exception as exc:
            raise WireError(
                f"the weight server at {source.address} did not answer the pull: {exc}"
            ) from None
        if "error" in answer:
            raise WireError(f"the weight server at {source.address} refused: {answer['error']}")
        return str(answer["header"]).encode()

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


def _group(
    store: dist.TCPStore, *, source: WeightSource, pull_id: str, timeout: timedelta
) -> dist.ProcessGroupGloo:
    """The pull's gloo group (rank 1), its socket on the address this host reaches the
    server from."""
    family = socket.AF_INET6 if ":" in source.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((source.host, source.port))  # no packet: only picks the route
        local = probe.getsockname()[0]
    return pull_group(store, pull_id=pull_id, rank=1, host=local, timeout=timeout)


def _connect_once(source: WeightSource) -> None:
    """One TCP connect to the server, at most CONNECT_S: the store client would retry a
    refused connection until its timeout (120 s), and a server that is gone stays gone.
    Raises WireUnreachable."""
    try:
        socket.create_connection((source.host, source.port), timeout=CONNECT_S).close()
    except OSError as exc:
        raise WireUnreachable(
            f"the weight server at {source.address} takes no connection ({exc}): it is gone"
        ) from None


def _receive(
    group: dist.ProcessGroupGloo,
    header: WireHeader,
    header_bytes: bytes,
    buffer: torch.Tensor,
    *,
    key: str,
) -> str:
    """Receive every window into `buffer`; each is tagged on a second thread while the next
    arrives. Returns the tag of the header and the buffer under the version's `key`."""
    tagger = VersionTagger(key, header.version, header_bytes)
    with ThreadPoolExecutor(1) as tagging:
        for index, window in enumerate(header.windows(buffer)):
            group.recv([window], 0, index).wait()  # type: ignore[attr-defined]  # not in the stubs
            tagging.submit(tagger.update, window.numpy())
    return tagger.hexdigest()


def _tell(store: dist.TCPStore, key: str, word: str) -> None:
    """Tell the server whether the pull goes on, or how it ended (its log); a server already
    gone is no error here (the pull has failed already, and says so)."""
    try:
        store.set(key, word[:300])
    except Exception:  # the sender died: nobody reads it
        return
