"""How a version's weights travel from the trainer to an inference worker over
torch.distributed: what a worker asks for, the layout of the bytes, and how both sides check
them. `training.weight_server` sends; `rollout.weight_receive` receives.

- **Layout**: a version is one flat byte buffer, each tensor at a 64-byte aligned offset, in
  the dtype the workers serve (full weights) or the trainer's own (LoRA adapters, megabytes).
  A `WireHeader` (JSON: version, kind, every tensor's name, dtype, shape and offset) says
  where each tensor lies.
- **Rendezvous**: the trainer's weight server listens with a `torch.distributed.TCPStore`. A
  worker pushes a `PullRequest` onto its queue (`REQUESTS`); the server answers under
  `answer_key(pull_id)` with the header (or why not), then both join a two-rank gloo group
  made for this pull alone (`group_prefix(pull_id)`, sender rank 0), so a restarted worker
  simply pulls again; the worker first says under `ready_key(pull_id)` whether the header
  fits its model (`READY`, else why not). The buffer goes over the group in windows of
  `WINDOW_BYTES`; the worker says how it ended under `done_key(pull_id)`.
- **Checks**: the tag is Poly1305 over the header's length, the header and the buffer, keyed
  from the version's key (`version_tagger`). The trainer computes it once per version and
  the router hands it to the worker with the reload, over HTTP behind the admin token: a
  worker installs only bytes that give the same tag, whoever else reaches the store (the
  TCPStore has no authentication, lists its keys to anyone, and gloo's sockets are plain
  TCP), since the key never travels there. A half transfer fails its receive or its tag and
  is never installed. Poly1305 rather than sha256 because a worker checks every pull on
  its hot path: 12.4 GB/s against sha256's 1.8 GB/s (with SHA extensions) and BLAKE2b's
  0.9 GB/s on this project's CPU machine; the bench's table gives what that is per pull.
- **A server that is gone**: a worker connects once (`CONNECT_S`), not with the store
  client's retries until its timeout, and says `UNREACHABLE` in its refusal, so the router
  sends that server no more pulls and loads the checkpoint instead.
- **Who may pull**: each version has a random key, handed to the router with the version
  and by the router to the worker. A request carries HMAC-SHA256(key, "version:pull_id"),
  never the key, and the server serves each pull id once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from cryptography.hazmat.primitives.poly1305 import Poly1305

if TYPE_CHECKING:  # torch costs seconds of start-up: the router and the clients only parse
    # sources, so it is imported where tensors are handled
    from datetime import timedelta

    import torch
    import torch.distributed as dist

REQUESTS = "weight-pulls"  # the TCPStore queue a worker pushes its PullRequest onto
READY = "ready"  # a worker's word that the header fits and it joins the group
WINDOW_BYTES = 256 * 1024 * 1024  # bytes per send: large enough to keep TCP busy
ALIGN = 64  # every tensor's offset: any dtype can view it, and vector loads stay aligned
CONNECT_S = 5.0  # one connect to the weight server: a refused or silent one means it is gone
UNREACHABLE = "weight_server_unreachable"  # the error code of a pull whose server is gone
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # the dtypes that travel
Kind = Literal["full", "adapter"]
_PULL_ID = re.compile(r"[0-9a-f]{32}")
_HEX32 = re.compile(r"[0-9a-f]{32}")


class WireError(RuntimeError):
    """A pull that failed; nothing of it was installed. The message says where and why."""


class WireUnreachable(WireError):
    """The weight server did not take a connection: it is gone (or never reachable from here),
    and later pulls from it would fail the same way."""


class WireMismatch(WireError):
    """What the weight server offers does not fit this worker's model (other tensors, shapes,
    or a dtype that would serve other weights than the checkpoint gives)."""


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise WireError(f"dtype {dtype} does not travel; use one of {sorted(ITEMSIZE)}")
    return name


@dataclass(frozen=True)
class WeightSource:
    """Where a version's weights can be pulled from, and how to check what arrives. Crosses
    trainer -> router -> worker, always behind the admin token (it carries the pull key)."""

    host: str
    port: int
    version: int
    tag: str  # the version's Poly1305 tag, hex (`version_tagger`)
    key: str = field(repr=False)  # the version's pull key: a secret

    def to_json(self) -> dict[str, Any]:
        """The body's `weights` field; the version travels beside it, in `version`."""
        return {"host": self.host, "port": self.port, "tag": self.tag, "key": self.key}

    @classmethod
    def from_json(cls, body: Any, *, version: int) -> WeightSource:
        """Raise WireError naming the bad field."""
        if not isinstance(body, dict):
            raise WireError("weights must be an object {host, port, tag, key}")
        host, port, tag, key = (body.get(k) for k in ("host", "port", "tag", "key"))
        if not isinstance(host, str) or not host or len(host) > 255:
            raise WireError("weights.host must be the weight server's address")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise WireError("weights.port must be a TCP port (1-65535)")
        if not isinstance(tag, str) or not _HEX32.fullmatch(tag):
            raise WireError("weights.tag must be 32 lowercase hex characters (Poly1305)")
        if not isinstance(key, str) or not 16 <= len(key) <= 256 or not key.isascii():
            raise WireError("weights.key must be the version's pull key (16-256 ASCII characters)")
        return cls(host=host, port=port, version=version, tag=tag, key=key)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # a key of ITEMSIZE
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * ITEMSIZE[self.dtype]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This tensor inside `buffer` (uint8 [total_bytes]), without a copy."""
        raw = buffer[self.offset : self.offset + self.nbytes]
        return raw.view(torch_dtype(self.dtype)).view(self.shape)


@dataclass(frozen=True)
class WireHeader:
    """The layout of one version's buffer. `encode` is canonical: the tag covers it."""

    version: int
    kind: Kind  # "full": every weight; "adapter": the LoRA adapters' weights only
    total_bytes: int
    window_bytes: int
    tensors: tuple[TensorEntry, ...]

    @classmethod
    def plan(
        cls,
        *,
        version: int,
        kind: Kind,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype | None,
        window_bytes: int = WINDOW_BYTES,
    ) -> WireHeader:
        """The layout of `tensors` (by name), in `dtype` (None: each tensor's own)."""
        entries, offset = [], 0
        for name, tensor in tensors.items():
            entry = TensorEntry(
                name=name,
                dtype=dtype_name(dtype or tensor.dtype),
                shape=tuple(tensor.shape),
                offset=offset,
            )
            entries.append(entry)
            offset = _aligned(offset + entry.nbytes)
        return cls(version, kind, offset, window_bytes, tuple(entries))

    def encode(self) -> bytes:
        return json.dumps(
            {
                "version": self.version,
                "kind": self.kind,
                "total_bytes": self.total_bytes,
                "window_bytes": self.window_bytes,
                "tensors": [[t.name, t.dtype, list(t.shape), t.offset] for t in self.tensors],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> WireHeader:
        """Parse and check a header from the store (anyone may have written it: every field
        is checked before a byte is allocated for it)."""
        try:
            body = json.loads(data)
            version, kind = body["version"], body["kind"]
            total, window = body["total_bytes"], body["window_bytes"]
            entries = tuple(
                TensorEntry(name=n, dtype=d, shape=tuple(s), offset=o)
                for n, d, s, o in body["tensors"]
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise WireError(f"the weight server sent a malformed header: {exc}") from None
        ints = [version, total, window] + [e.offset for e in entries]
        ints += [d for e in entries for d in e.shape]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise WireError("the header's sizes, offsets and shapes must be non-negative integers")
        if kind not in ("full", "adapter") or not 0 < window <= 1 << 34:
            raise WireError(f"the header's kind {kind!r} or window {window} is not valid")
        end = 0
        for entry in entries:
            if not isinstance(entry.name, str) or entry.dtype not in ITEMSIZE:
                raise WireError(f"the header's tensor {entry.name!r} has dtype {entry.dtype!r}")
            if entry.offset % ALIGN or entry.offset < end:
                raise WireError(f"the header's tensor {entry.name} overlaps or is not aligned")
            end = entry.offset + entry.nbytes
        if len({e.name for e in entries}) != len(entries) or total != _aligned(end):
            raise WireError("the header names a tensor twice, or its size does not add up")
        return cls(version, kind, total, window, entries)

    def windows(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The slices of `buffer` sent one after another (views)."""
        return [
            buffer[start : start + self.window_bytes]
            for start in range(0, self.total_bytes, self.window_bytes)
        ]


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class VersionTagger:
    """Poly1305 over one version: the header's length (8 bytes), the header, then the buffer
    fed window by window in order. Keyed from the version's key, so nobody without the key
    (which never reaches the store or the gloo sockets) can make bytes that give the tag."""

    def __init__(self, key: str, version: int, header_bytes: bytes) -> None:
        one_time = hmac.new(key.encode(), f"tag:{version}".encode(), hashlib.sha256).digest()
        self._mac = Poly1305(one_time)  # one message per key: one version's one layout
        self._mac.update(struct.pack("<Q", len(header_bytes)) + header_bytes)

    def update(self, data: Any) -> None:
        self._mac.update(data)

    def hexdigest(self) -> str:
        return self._mac.finalize().hex()


def tags_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass(frozen=True)
class PullRequest:
    """What a worker pushes onto the weight server's queue."""

    pull_id: str  # 32 hex characters, fresh for every pull
    version: int
    proof: str  # pull_proof(key, version, pull_id)
    worker: str  # who pulls, for the server's log

    def encode(self) -> bytes:
        return json.dumps(
            {
                "pull_id": self.pull_id,
                "version": self.version,
                "proof": self.proof,
                "worker": self.worker,
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> PullRequest:
        try:
            body = json.loads(data)
            request = cls(
                str(body["pull_id"]), body["version"], str(body["proof"]), str(body["worker"])[:200]
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise WireError(f"a malformed pull request: {exc}") from None
        if not _PULL_ID.fullmatch(request.pull_id) or not isinstance(request.version, int):
            raise WireError("a pull request needs a 32-hex pull_id and an integer version")
        return request


def pull_proof(key: str, version: int, pull_id: str) -> str:
    return hmac.new(key.encode(), f"{version}:{pull_id}".encode(), hashlib.sha256).hexdigest()


def proof_valid(key: str, request: PullRequest) -> bool:
    expected = pull_proof(key, request.version, request.pull_id)
    return hmac.compare_digest(expected.encode(), request.proof.encode())


def answer_key(pull_id: str) -> str:
    return f"pull/{pull_id}/answer"


def ready_key(pull_id: str) -> str:
    return f"pull/{pull_id}/ready"


def done_key(pull_id: str) -> str:
    return f"pull/{pull_id}/done"


def pull_group(
    store: dist.Store, *, pull_id: str, rank: int, host: str, timeout: timedelta
) -> dist.ProcessGroupGloo:
    """The two-rank gloo group of one pull (rank 0 sends, rank 1 receives), its socket on
    `host` (this side's address); blocks until the other rank joins, at most `timeout`.
    Standalone, no default group: every pull is a group of its own."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pull/{pull_id}/group", store), rank, 2, options)
