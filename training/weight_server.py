"""The trainer's weight server: the newest published version's weights, held in memory and
sent over torch.distributed (gloo) to each inference worker that pulls them, so a sync
touches no disk. `core.weight_wire` is the format and the checks; `rollout.weight_receive`
is the worker's side.

    server = WeightServer(host="10.0.0.5")  # a TCPStore on that address, a free port
    source = server.publish(version=3, kind="full", tensors=weights, dtype=torch.bfloat16)
    # the router gets `source` with the version (POST /admin/sync) and hands it to workers
    server.close()

`publish` copies the weights into one flat buffer (the snapshot; the trainer trains on
meanwhile) and tags it once (`core.weight_wire.VersionTagger`); every pull then sends that buffer in windows over a two-rank
gloo group of its own. A pull of an older version than the newest is refused: the router
has moved on, or loads it from its checkpoint.

The trainer's worker process holds one per run (`workers.training_loop`); bench/weight_sync.py
runs one as a sender that holds only a checkpoint's weights.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from core.weight_wire import (
    READY,
    REQUESTS,
    WINDOW_BYTES,
    Kind,
    PullRequest,
    VersionTagger,
    WeightSource,
    WireError,
    WireHeader,
    answer_key,
    done_key,
    proof_valid,
    pull_group,
    ready_key,
)

log = logging.getLogger("dartboard.weight_server")

TAG_CHUNK = 64 * 1024 * 1024  # the snapshot is tagged in chunks this size as they are copied
SEEN_PULLS = 4096  # pull ids remembered per version (each is served once)


@dataclass
class Snapshot:
    """One published version: its buffer, layout, tag and pull key. Read-only while
    served; a pull in progress keeps it alive after a newer version replaces it."""

    header: WireHeader
    header_bytes: bytes
    buffer: torch.Tensor  # uint8 [header.total_bytes]
    tag: str
    key: str
    sending: int = 0  # pulls under way (WeightServer._lock): its buffer is not reused meanwhile


@dataclass(frozen=True)
class PullRecord:
    """One pull as the server saw it (`WeightServer.pulls`)."""

    worker: str
    version: int
    bytes: int
    seconds: float
    outcome: str  # the worker's verdict ("verified", "refused: ..."), or the send's error


def snapshot_of(
    header: WireHeader, tensors: dict[str, torch.Tensor], *, buffer: torch.Tensor | None = None
) -> Snapshot:
    """Copy `tensors` into `buffer` (new when None) as `header` lays them out (casting them
    to its dtypes), and tag it under a new pull key. Each chunk is tagged on a second thread
    while the next tensors are copied."""
    header_bytes = header.encode()
    if buffer is None:
        buffer = torch.empty(header.total_bytes, dtype=torch.uint8)
    key = secrets.token_urlsafe(32)
    tagger = VersionTagger(key, header.version, header_bytes)
    tagged = 0
    ends = [e.offset for e in header.tensors[1:]] + [header.total_bytes]
    with torch.no_grad(), ThreadPoolExecutor(1) as tagging:
        for entry, next_offset in zip(header.tensors, ends, strict=True):
            entry.view(buffer).copy_(tensors[entry.name].detach())
            end = entry.offset + entry.nbytes
            buffer[end:next_offset].zero_()  # the alignment gap is tagged too: no stale bytes
            if end - tagged >= TAG_CHUNK:
                tagging.submit(tagger.update, buffer[tagged:end].numpy())
                tagged = end
        tagging.submit(tagger.update, buffer[tagged:].numpy())
    return Snapshot(header, header_bytes, buffer, tagger.hexdigest(), key)


class WeightServer:
    """Serves the newest published version to the workers that pull it (module doc).

    One thread reads pull requests off the store's queue and answers them; each admitted
    pull is sent from a thread of its own, so several workers can pull at once. `_lock`
    guards the current snapshot, the pull ids seen and the records."""

    def __init__(
        self,
        *,
        host: str,
        port: int = 0,
        timeout_s: float = 120.0,
        window_bytes: int = WINDOW_BYTES,
    ) -> None:
        """`host`: the address the store and the gloo sockets listen on, and that workers
        connect to (the trainer host's, reachable from every inference host). `timeout_s`:
        how long a pull may wait on the worker (joining the group, each window)."""
        self.host = host
        self.timeout = timedelta(seconds=timeout_s)
        self.window_bytes = window_bytes
        # Our own listening socket, so the store listens on `host` alone (TCPStore's own
        # listens on every interface).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(512)
        self.port = int(listener.getsockname()[1])
        self._store = dist.TCPStore(
            host,
            self.port,
            None,
            True,
            self.timeout,
            wait_for_workers=False,
            master_listen_fd=listener.detach(),
        )
        # The request loop blocks on the queue through its own connection, which waits a
        # long time (a store connection has one timeout for every call).
        self._requests = dist.TCPStore(host, self.port, None, False, timedelta(days=7))
        self._stop_word = secrets.token_hex(16).encode()  # unguessable: nobody else stops us
        self._lock = threading.Lock()
        self._current: Snapshot | None = None
        self._seen: set[str] = set()
        self.pulls: list[PullRecord] = []
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()

    def publish(
        self,
        *,
        version: int,
        kind: Kind,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype | None = None,
    ) -> WeightSource:
        """Make `tensors` (by parameter name) the version workers pull, in `dtype` (None: as
        they are); returns where and how to pull it. Blocks for the copy and the tag. The
        previous version's buffer is filled again when no pull is reading it (no second
        copy of the weights); it is not served meanwhile."""
        header = WireHeader.plan(
            version=version,
            kind=kind,
            tensors=tensors,
            dtype=dtype,
            window_bytes=self.window_bytes,
        )
        with self._lock:
            old, reuse = self._current, None
            if (
                old is not None
                and old.sending == 0
                and old.header.total_bytes == header.total_bytes
            ):
                reuse, self._current = old.buffer, None
        snapshot = snapshot_of(header, tensors, buffer=reuse)
        with self._lock:
            self._current = snapshot
            self._seen = set()
        log.info(
            "version %d (%s, %.0f MB) served on %s:%d",
            version,
            kind,
            snapshot.header.total_bytes / 1e6,
            self.host,
            self.port,
        )
        return WeightSource(
            host=self.host,
            port=self.port,
            version=version,
            tag=snapshot.tag,
            key=snapshot.key,
        )

    def close(self) -> None:
        """Stop taking pulls (those under way end with their sockets) and free the snapshot."""
        if self._thread.is_alive():  # through another connection: the loop's is blocked
            self._store.queue_push(REQUESTS, self._stop_word)
            self._thread.join(timeout=10)
        with self._lock:
            self._current = None

    # --------------------------------------------------------------- pulls

    def _serve(self) -> None:
        while True:
            raw = self._requests.queue_pop(REQUESTS, block=True)
            if raw == self._stop_word:
                return
            try:
                request = PullRequest.decode(raw)
            except WireError as exc:  # no pull id to answer to: said in the log only
                log.warning("weight server: %s", exc)
                continue
            snapshot, refusal = self._admit(request)
            if snapshot is None:
                log.warning("weight server: pull by %s refused: %s", request.worker, refusal)
                self._answer(request.pull_id, {"error": refusal})
                continue
            self._answer(request.pull_id, {"header": snapshot.header_bytes.decode()})
            threading.Thread(
                target=self._send, args=(request, snapshot), name="weight-send", daemon=True
            ).start()

    def _admit(self, request: PullRequest) -> tuple[Snapshot | None, str]:
        with self._lock:
            current = self._current
            if current is None:
                return None, "no version is served now (none yet, or one is being published)"
            if request.version != current.header.version:
                return None, (
                    f"version {request.version} is not served; the newest is "
                    f"{current.header.version}"
                )
            if not proof_valid(current.key, request):
                return None, "the pull's proof does not match this version's key"
            if request.pull_id in self._seen or len(self._seen) >= SEEN_PULLS:
                return None, "this pull id was served already"
            self._seen.add(request.pull_id)
            current.sending += 1
            return current, ""

    def _answer(self, pull_id: str, body: dict[str, str]) -> None:
        self._store.set(answer_key(pull_id), json.dumps(body))

    def _send(self, request: PullRequest, snapshot: Snapshot) -> None:
        started = time.monotonic()
        outcome = ""
        try:
            # The worker checks the header first: a version that does not fit its model is
            # refused before anyone joins a group.
            self._store.wait([ready_key(request.pull_id)], self.timeout)
            ready = self._store.get(ready_key(request.pull_id)).decode()
            if ready != READY:
                raise WireError(ready)
            group = pull_group(
                self._store, pull_id=request.pull_id, rank=0, host=self.host, timeout=self.timeout
            )
            for index, window in enumerate(snapshot.header.windows(snapshot.buffer)):
                self._send_window(group, window, index)
            self._store.wait([done_key(request.pull_id)], self.timeout)
            outcome = self._store.get(done_key(request.pull_id)).decode()
        except WireError as exc:
            outcome = str(exc)
        except Exception as exc:  # the worker died or left: its pull fails, the server goes on
            outcome = f"send failed: {type(exc).__name__}: {str(exc)[:300]}"
            log.warning("weight server: pull by %s: %s", request.worker, outcome)
        finally:
            self._forget(request.pull_id)
            with self._lock:
                snapshot.sending -= 1
        record = PullRecord(
            worker=request.worker,
            version=request.version,
            bytes=snapshot.header.total_bytes,
            seconds=time.monotonic() - started,
            outcome=outcome,
        )
        with self._lock:
            self.pulls.append(record)
            del self.pulls[:-100]
        log.info("weight server: %s", record)

    def _send_window(self, group: dist.ProcessGroupGloo, window: torch.Tensor, index: int) -> None:
        group.send([window], 1, index).wait()  # type: ignore[attr-defined]  # not in the stubs

    def _forget(self, pull_id: str) -> None:
        """Delete the pull's keys (its answer, verdict and the group's rendezvous)."""
        prefix = f"pull/{pull_id}/"
        for key in self._store.list_keys():
            if key.lstrip("/").startswith(prefix):
                self._store.delete_key(key)
