"""One pull of a version from the trainer's weight server (`core.weight_wire`): ask for it,
check its header, receive its buffer over a two-rank gloo group and check its tag. Needs
torch and `core.weight_wire` only, so both the transformers server
(`rollout.weight_receive`) and vLLM's worker process (`rollout.vllm_weights`) pull with it:

    pulled = pull_version(source, worker="host:8101", timeout=timedelta(seconds=120),
                          fits=check_header, buffer_for=lambda n: torch.empty(n, dtype=torch.uint8))
    tensors = {e.name: e.view(pulled.buffer) for e in pulled.header.tensors}
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

from core.weight_wire import (
    CONNECT_S,
    READY,
    REQUESTS,
    PullRequest,
    VersionTagger,
    WeightSource,
    WireError,
    WireHeader,
    WireUnreachable,
    answer_key,
    done_key,
    pull_group,
    pull_proof,
    ready_key,
    tags_equal,
)


class PullFailed(WireError):
    """A pull that broke off or was refused after its buffer was taken: the buffer (filled
    partly or with bytes that do not give the tag) is handed back for reuse, never for an
    install."""

    def __init__(self, message: str, *, buffer: torch.Tensor) -> None:
        super().__init__(message)
        self.buffer = buffer


@dataclass(frozen=True)
class Pulled:
    header: WireHeader
    buffer: torch.Tensor  # uint8 [header.total_bytes], verified against the version's tag
    seconds: float


def pull_version(
    source: WeightSource,
    *,
    worker: str,
    timeout: timedelta,
    fits: Callable[[WireHeader], object],
    buffer_for: Callable[[int], torch.Tensor],
) -> Pulled:
    """Receive `source`'s version. `fits(header)` raises WireMismatch when the version does
    not fit the caller's model (the server is told, nothing is received); `buffer_for(n)`
    gives the uint8 buffer of n bytes to receive into. `worker` names the caller in the
    server's log; `timeout` bounds each wait (the answer, the group, a window).

    Raises WireUnreachable when the server takes no connection, WireMismatch from `fits`,
    PullFailed (carrying the buffer) when the transfer broke off or the bytes do not give
    the version's tag, WireError for anything else (refused, no answer)."""
    started = time.monotonic()
    _connect_once(source)
    try:
        store = dist.TCPStore(source.host, source.port, None, False, timeout)
    except Exception as exc:  # c10d raises its own error classes
        raise WireError(f"the weight server at {source.address} did not answer: {exc}") from None
    pull_id = secrets.token_hex(16)
    proof = pull_proof(source.key, source.version, pull_id)
    store.queue_push(REQUESTS, PullRequest(pull_id, source.version, proof, worker).encode())
    header_bytes = _answer(store, source, pull_id, timeout)
    try:
        header = WireHeader.decode(header_bytes)
        fits(header)
    except WireError as exc:
        _tell(store, ready_key(pull_id), f"refused: {exc}")
        raise
    _tell(store, ready_key(pull_id), READY)
    buffer = buffer_for(header.total_bytes)
    try:
        group = _group(store, source=source, pull_id=pull_id, timeout=timeout)
        tag = _receive(group, header, header_bytes, buffer, key=source.key)
    except Exception as exc:
        _tell(store, done_key(pull_id), f"failed: {exc}")
        raise PullFailed(
            f"the pull of version {source.version} from {source.address} broke off: "
            f"{type(exc).__name__}: {str(exc)[:300]}",
            buffer=buffer,
        ) from None
    if not tags_equal(tag, source.tag):
        _tell(store, done_key(pull_id), "refused: tag mismatch")
        raise PullFailed(
            f"version {source.version} from {source.address} gives the tag {tag}, but the "
            f"trainer published {source.tag}: not installed",
            buffer=buffer,
        )
    _tell(store, done_key(pull_id), "verified")
    return Pulled(header, buffer, time.monotonic() - started)


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


def _answer(store: dist.TCPStore, source: WeightSource, pull_id: str, timeout: timedelta) -> bytes:
    try:
        store.wait([answer_key(pull_id)], timeout)
        answer = json.loads(store.get(answer_key(pull_id)))
    except Exception as exc:
        raise WireError(
            f"the weight server at {source.address} did not answer the pull: {exc}"
        ) from None
    if "error" in answer:
        raise WireError(f"the weight server at {source.address} refused: {answer['error']}")
    return str(answer["header"]).encode()


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
