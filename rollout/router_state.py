"""The router's state machine: the worker table, least-loaded routing, the liveness prober
and the rolling, one-worker-at-a-time weight sync. `rollout.router` serves it over HTTP (its
module doc lists the endpoints and how to run it); `rollout.client.RouterAdmin` drives it.

A worker whose /health says `swaps_live` (the transformers server) loads a version beside
the live one and swaps it in between batches: the sync reloads it while it stays active,
drained by nobody. Other workers (vLLM's full-weight reload) are drained first. A worker
that says `pulls_weights` is sent the trainer's weight server, when the sync names one, and
the checkpoint only if that pull fails; a server one worker could not connect to is gone
(the trainer died), and every later reload goes straight to the checkpoint until a sync
names a server again.

A worker's status is a `rollout.client.WorkerStatus` (what each one means is said there). A
background prober polls every worker's /health and brings suspect and dead workers back. No
Django here: the router runs on inference hosts without the database.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from core.weight_wire import UNREACHABLE, WeightSource
from rollout.asgi import error_body
from rollout.auth import ServiceTokens, bearer
from rollout.client import WorkerInfo, WorkerStatus

log = logging.getLogger("rollout.router")

RETRY_ELSEWHERE = frozenset({502, 503, 504})
# A worker whose reload failed because its artifact store did not answer (503) is given the
# version again this much later; any other failed reload is not retried for that version.
RELOAD_RETRY_S = 5.0


class NoWorkerAvailable(Exception):
    """No active worker appeared within the wait bound; the message says what to do."""


class SyncRejected(ValueError):
    """A sync request that would move the policy backwards or names no checkpoint."""


@dataclass(frozen=True)
class UpstreamReply:
    """What the router sends back for one chat request."""

    status: int
    body: dict[str, Any]
    worker: str
    upstream_ms: float = 0.0  # time spent in the worker's request (the router's own cost excluded)


@dataclass
class _Worker:
    """Mutable router-side state of one worker; guarded by Router._cond."""

    url: str
    status: WorkerStatus = WorkerStatus.DEAD
    in_flight: int = 0
    policy_version: int | None = None
    served: int = 0
    failures: int = 0  # consecutive probe/forward failures
    last_error: str = ""
    failed_version: int | None = None  # a reload to this version failed: do not retry it
    retry_reload_at: float = 0.0  # its store was unreachable: retry no sooner (monotonic)
    loaded_run: int | None = None  # the run whose checkpoint the router loaded here (None: unknown)
    model: str = ""  # the name its /health reports
    swaps_live: bool = False  # reloads with no pause: never drained (its /health says so)
    pulls_weights: bool = False  # takes weights from the trainer's weight server

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            url=self.url,
            status=self.status,
            in_flight=self.in_flight,
            policy_version=self.policy_version,
            served=self.served,
            failures=self.failures,
            last_error=self.last_error,
        )


class Router:
    """Worker registry, least-loaded routing, the liveness prober and the sync thread.

    `_cond` guards every _Worker, target/checkpoint and the event log. The sync thread owns
    workers while they are draining or loading: the prober and the forward path leave
    those statuses alone except to record a death.
    """

    def __init__(
        self,
        *,
        wait_timeout: float = 60.0,
        request_timeout: float = 600.0,
        probe_interval: float = 1.0,
        reload_timeout: float = 600.0,
        tokens: ServiceTokens | None = None,
        roots: list[Path] | None = None,
    ):
        self.wait_timeout = wait_timeout
        self.request_timeout = request_timeout
        self.probe_interval = probe_interval
        self.reload_timeout = reload_timeout
        self.target_version: int | None = None
        self.target_run: int | None = None  # versions count per run; a new run starts anew
        self.checkpoint: str | None = None
        self.weights: WeightSource | None = None  # where the target can be pulled from
        self.rolling = True  # False: every worker reloads at once (synchronous baseline)
        self.syncing = False
        self._workers: dict[str, _Worker] = {}
        self._rr = 0
        self._cond = threading.Condition()
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=2000)
        self._seq = 0
        self._stop = threading.Event()
        self.roots = roots or []
        self._http = httpx.Client(
            timeout=request_timeout, headers=bearer(tokens.inference if tokens else None)
        )
        self._admin = bearer(tokens.admin if tokens else None)  # sent with a worker's reload
        self._threads = [
            threading.Thread(target=self._probe_loop, name="router-prober", daemon=True),
            threading.Thread(target=self._sync_loop, name="router-sync", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        self._http.close()

    # --------------------------------------------------------- registry

    def register(self, url: str) -> WorkerInfo:
        """Add a worker (idempotent); probe it now so a healthy one serves at once."""
        url = normalize_url(url)
        with self._cond:
            worker = self._workers.get(url)
            if worker is None:
                worker = self._workers[url] = _Worker(url=url)
                self._event(worker, "registered")
        self._probe(worker)
        with self._cond:
            return worker.info()

    def unregister(self, url: str) -> bool:
        """Stop routing to `url`; its in-flight requests still finish. False if unknown."""
        with self._cond:
            worker = self._workers.pop(normalize_url(url), None)
            if worker is not None:
                self._event(worker, "unregistered")
                self._cond.notify_all()
            return worker is not None

    def workers(self) -> list[WorkerInfo]:
        with self._cond:
            return [w.info() for w in self._workers.values()]

    def models(self) -> list[str]:
        """The model names the live workers serve (GET /v1/models)."""
        with self._cond:
            live = [w for w in self._workers.values() if w.status != WorkerStatus.DEAD and w.model]
            return sorted({w.model for w in live})

    def health(self) -> dict[str, Any]:
        with self._cond:
            active = sum(w.status == WorkerStatus.ACTIVE for w in self._workers.values())
            return {
                "status": "ok" if active else "unavailable",
                "active": active,
                "workers": [asdict(w.info()) for w in self._workers.values()],
                "target_version": self.target_version,
                "syncing": self.syncing,
            }

    def events(self) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._events)

    def _event(
        self,
        worker: _Worker,
        status: WorkerStatus | Literal["registered", "unregistered", "swapped", "pull failed"],
        detail: str = "",
    ) -> None:
        """Record a status change (or a registration, a version swapped in while the worker
        served, or a pull that failed). Caller holds _cond."""
        if isinstance(status, WorkerStatus):
            if worker.status == status:
                return
            worker.status = status
        self._seq += 1
        self._events.append(
            {
                "seq": self._seq,
                "at": datetime.now(UTC).isoformat(),
                "worker": worker.url,
                "status": status,
                "policy_version": worker.policy_version,
                "detail": detail,
            }
        )
        log.info("%s -> %s (v%s) %s", worker.url, status, worker.policy_version, detail)

    # --------------------------------------------------------- routing

    def complete(self, body: bytes, *, timeout: float | None = None) -> UpstreamReply:
        """Forward one chat-completions body; retry elsewhere on worker failure (module doc).

        Raises NoWorkerAvailable when no active worker appears within the wait bound.
        """
        total = self.request_timeout if timeout is None else min(timeout, self.request_timeout)
        deadline = time.monotonic() + total
        tried_500: set[str] = set()
        last_500: UpstreamReply | None = None
        while True:
            worker = self._acquire(deadline=deadline, exclude=tried_500)
            if worker is None:  # every active worker already failed this request with a 500
                assert last_500 is not None
                return last_500
            sent = time.perf_counter()
            try:
                response = self._http.post(
                    f"{worker.url}/v1/chat/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=max(0.1, deadline - time.monotonic()),
                )
            except httpx.TimeoutException as exc:
                self._release(worker, failed=f"timed out: {exc}", status=WorkerStatus.SUSPECT)
                if time.monotonic() >= deadline:
                    return _error_reply(504, f"no reply within {total:g} s", worker.url)
                continue
            except httpx.HTTPError as exc:
                self._release(
                    worker, failed=f"{type(exc).__name__}: {exc}", status=WorkerStatus.DEAD
                )
                continue
            if response.status_code in RETRY_ELSEWHERE:
                self._release(
                    worker, failed=f"answered {response.status_code}", status=WorkerStatus.SUSPECT
                )
                continue
            upstream_ms = (time.perf_counter() - sent) * 1000.0
            self._release(worker, served=response.status_code == 200)
            reply = UpstreamReply(
                response.status_code, _json_or_error(response), worker.url, upstream_ms
            )
            if response.status_code == 200:
                reply.body["served_by"] = worker.url
                version = reply.body.get("policy_version")
                with self._cond:  # a reply generated before a reload must not undo it
                    if isinstance(version, int) and version > (worker.policy_version or 0):
                        worker.policy_version = version
                return reply
            if response.status_code != 500:
                return reply  # the request's own fault (4xx): another worker would agree
            tried_500.add(worker.url)
            last_500 = reply

    def _acquire(self, *, deadline: float, exclude: set[str]) -> _Worker | None:
        """Pick the least-loaded active worker and count the request against it."""
        wait_until = min(deadline, time.monotonic() + self.wait_timeout)
        with self._cond:
            while True:
                active = [w for w in self._workers.values() if w.status == WorkerStatus.ACTIVE]
                candidates = [w for w in active if w.url not in exclude]
                if candidates:
                    least = min(w.in_flight for w in candidates)
                    tied = [w for w in candidates if w.in_flight == least]
                    worker = tied[self._rr % len(tied)]
                    self._rr += 1
                    worker.in_flight += 1
                    return worker
                if active:
                    return None
                remaining = wait_until - time.monotonic()
                if remaining <= 0:
                    raise NoWorkerAvailable(self._no_worker_message())
                self._cond.wait(timeout=remaining)

    def _no_worker_message(self) -> str:
        """Caller holds _cond."""
        if not self._workers:
            return (
                f"no inference worker is registered (waited {self.wait_timeout:g} s); "
                'register one with POST /admin/workers {"url": ...}'
            )
        states = ", ".join(f"{w.url} {w.status}" for w in self._workers.values())
        return f"no active inference worker within {self.wait_timeout:g} s ({states})"

    def _release(
        self,
        worker: _Worker,
        *,
        served: bool = False,
        failed: str = "",
        status: WorkerStatus = WorkerStatus.SUSPECT,
    ) -> None:
        with self._cond:
            worker.in_flight -= 1
            if served:
                worker.served += 1
                worker.failures = 0
            if failed:
                worker.failures += 1
                worker.last_error = failed
                # A death always counts; a 503 from a worker the sync thread is reloading
                # is expected and leaves the status to the sync thread.
                if status == WorkerStatus.DEAD or worker.status == WorkerStatus.ACTIVE:
                    self._event(worker, status, failed)
            self._cond.notify_all()

    # --------------------------------------------------------- liveness

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval):
            with self._cond:
                workers = list(self._workers.values())
            for worker in workers:
                self._probe(worker)

    def _probe(self, worker: _Worker) -> None:
        """GET /health of one worker and update its status (not while the sync owns it)."""
        try:
            response = self._http.get(f"{worker.url}/health", timeout=3.0)
            health = response.json() if response.status_code == 200 else None
            error = "" if health else f"/health answered {response.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            health, error = None, f"/health: {type(exc).__name__}: {exc}"
        with self._cond:
            if self._workers.get(worker.url) is not worker or worker.status in (
                WorkerStatus.DRAINING,
                WorkerStatus.LOADING,
            ):
                return
            if health is None:
                worker.failures += 1
                worker.last_error = error
                refused = "ConnectError" in error
                if refused or worker.failures >= 3:
                    self._event(worker, WorkerStatus.DEAD, error)
                elif worker.status == WorkerStatus.ACTIVE:
                    self._event(worker, WorkerStatus.SUSPECT, error)
                return
            worker.failures = 0
            if isinstance(health.get("model"), str):
                worker.model = health["model"]
            if isinstance(health.get("policy_version"), int):
                worker.policy_version = health["policy_version"]
            worker.swaps_live = health.get("swaps_live") is True
            worker.pulls_weights = health.get("pulls_weights") is True
            if health.get("status", "ok") != "ok":
                self._event(worker, WorkerStatus.SUSPECT, f"worker reports {health.get('status')}")
            elif worker.status != WorkerStatus.ACTIVE and self._needs_reload(worker):
                # Only a worker coming (back) into service waits for its reload; an active
                # one behind the target keeps serving until the rolling sync reaches it.
                self._event(worker, WorkerStatus.STALE, f"behind target v{self.target_version}")
            else:
                self._event(worker, WorkerStatus.ACTIVE)
            self._cond.notify_all()

    def _needs_reload(self, worker: _Worker) -> bool:
        """Caller holds _cond. Behind the target version, or holding another run's weights.
        A worker whose run is unknown (started by the launcher with the run's current
        checkpoint) counts as current when its version equals the target."""
        if self.target_version is None or self.checkpoint is None:
            return False
        if worker.policy_version is None or worker.failed_version == self.target_version:
            return False
        if time.monotonic() < worker.retry_reload_at:
            return False
        if worker.loaded_run is not None and worker.loaded_run != self.target_run:
            return True
        return worker.policy_version < self.target_version

    # --------------------------------------------------------- weight sync

    def request_sync(
        self,
        *,
        checkpoint: str,
        version: int,
        run: int | None = None,
        rolling: bool = True,
        weights: WeightSource | None = None,
    ) -> dict[str, Any]:
        """Set the target version; the sync thread rolls it out (module doc). Non-blocking.
        `weights`: the trainer's weight server holding it (workers that pull try it first).

        Within one run the policy never moves backwards; a different `run` starts its own
        numbering (its workers reload even at a lower version number)."""
        with self._cond:
            new_run = run is not None and run != self.target_run
            if not new_run:
                newest = max(
                    [self.target_version or 0]
                    + [
                        w.policy_version or 0
                        for w in self._workers.values()
                        if w.loaded_run in (None, self.target_run)
                    ]
                )
                if version < newest:
                    raise SyncRejected(
                        f"version {version} is older than version {newest} already published: "
                        "the router never moves the policy backwards"
                    )
            if new_run:
                for worker in self._workers.values():
                    worker.failed_version = None
                    if worker.loaded_run is None and worker.policy_version != version:
                        worker.loaded_run = -1  # unknown weights: reload them
            self.target_version = version
            self.target_run = run if run is not None else self.target_run
            self.checkpoint = checkpoint
            self.weights = weights
            self.rolling = rolling
            self.syncing = any(self._needs_reload(w) for w in self._workers.values())
            self._cond.notify_all()
            return {
                "target_version": version,
                "run": self.target_run,
                "checkpoint": checkpoint,
                "weights": weights.address if weights is not None else None,
                "rolling": rolling,
                "syncing": self.syncing,
            }

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                worker = self._next_to_sync()
                self.syncing = worker is not None
                if worker is None:
                    # Woken by a sync request, a registration or a probe; the timeout
                    # only bounds how late a missed notification is noticed.
                    self._cond.wait(timeout=1.0)
                    continue
                checkpoint, version, rolling = self.checkpoint, self.target_version, self.rolling
                weights = self.weights
                batch = (
                    [worker]
                    if rolling
                    else [
                        w
                        for w in self._workers.values()
                        if w.status in (WorkerStatus.ACTIVE, WorkerStatus.STALE)
                        and self._needs_reload(w)
                    ]
                )
            assert checkpoint is not None and version is not None
            # Rolling: one worker reloads while the others serve. All at once (the
            # synchronous baseline): every worker is drained first, then all reload. A worker
            # that swaps live is drained by neither.
            ready = [w for w in batch if w.swaps_live or self._drain(w, version=version)]
            for w in ready:
                self._reload(w, checkpoint=checkpoint, version=version, weights=weights)

    def _next_to_sync(self) -> _Worker | None:
        """A worker behind the target: idle stale ones first, then the least-loaded active.
        Caller holds _cond."""
        behind = [
            w
            for w in self._workers.values()
            if w.status in (WorkerStatus.ACTIVE, WorkerStatus.STALE)
        ]
        behind = [w for w in behind if self._needs_reload(w)]
        if not behind:
            return None
        return min(behind, key=lambda w: (w.status == WorkerStatus.ACTIVE, w.in_flight))

    def _drain(self, worker: _Worker, *, version: int) -> bool:
        """Stop routing to `worker` and wait for its in-flight requests. True when drained."""
        with self._cond:
            self._event(worker, WorkerStatus.DRAINING, f"for v{version}")
            drained = self._cond.wait_for(
                lambda: worker.in_flight == 0 or self._stop.is_set(),
                timeout=self.request_timeout + 5,
            )
            if self._stop.is_set():
                return False
            if (
                not drained or worker.status != WorkerStatus.DRAINING
            ):  # died (or vanished) meanwhile
                if worker.status == WorkerStatus.DRAINING:
                    self._event(worker, WorkerStatus.SUSPECT, "in-flight requests never finished")
                return False
            return True

    def _reload(
        self, worker: _Worker, *, checkpoint: str, version: int, weights: WeightSource | None
    ) -> None:
        """Load `version` on `worker` (drained, or one that swaps live and goes on serving),
        wait for it to report it, make it active: pulled from `weights` where the worker
        pulls, else (or when the pull fails) from `checkpoint`."""
        with self._cond:
            live = worker.swaps_live and worker.status == WorkerStatus.ACTIVE
            pull = (
                weights is not None
                and worker.pulls_weights
                and weight_server_reaches(weights.host, worker.url)
            )
            where = f"the weight server {weights.address}" if pull and weights else checkpoint
            if not live:
                self._event(worker, WorkerStatus.LOADING, f"v{version} from {where}")
            run = self.target_run
        started = time.monotonic()
        response = None
        if pull and weights is not None:
            body = {"version": version, "weights": weights.to_json()}
            response = self._post_reload(worker, body)
            if response is not None and response.status_code not in (200, 409):
                self._pull_failed(worker, weights, _json_or_error(response).get("error", {}))
                response = None  # the checkpoint, which the trainer also published
        if response is None:
            response = self._post_reload(worker, {"checkpoint": checkpoint, "version": version})
        if response is None:
            return
        if response.status_code not in (200, 409):  # 409: a reload already runs there
            with self._cond:
                if response.status_code == 503:  # its artifact store did not answer: later
                    worker.retry_reload_at = time.monotonic() + RELOAD_RETRY_S
                else:
                    worker.failed_version = version
                worker.last_error = f"reload to v{version} failed: {_json_or_error(response)}"
                # It kept its old weights and still serves; the error is on the worker row.
                self._event(worker, WorkerStatus.SUSPECT, worker.last_error)
            return
        with self._cond:
            worker.loaded_run = run
        self._await_version(worker, version=version)
        reply = _json_or_error(response)
        origin = "the weight server" if reply.get("source") == "weights" else "the checkpoint"
        detail = (
            f"v{version} from {origin} in {time.monotonic() - started:.2f} s, generation "
            f"paused {reply.get('swap_ms', '?')} ms"
        )
        log.info("%s: %s", worker.url, detail)
        if live:
            with self._cond:
                self._event(worker, "swapped", detail)

    def _pull_failed(self, worker: _Worker, weights: WeightSource, error: dict[str, Any]) -> None:
        """Record a failed pull on the worker's events; when the server took no connection,
        forget it, so later reloads load the checkpoint without trying it (until a sync
        names a server again)."""
        gone = error.get("code") == UNREACHABLE
        with self._cond:
            if gone and self.weights is weights:
                self.weights = None
            detail = f"v{weights.version} from {weights.address}: {error.get('message', '')}"
            self._event(worker, "pull failed", f"{detail}; the checkpoint instead")

    def _post_reload(self, worker: _Worker, body: dict[str, Any]) -> httpx.Response | None:
        """POST /v1/reload; None (the worker marked dead) when it does not answer."""
        try:
            return self._http.post(
                f"{worker.url}/v1/reload",
                json=body,
                headers=self._admin,
                timeout=self.reload_timeout,
            )
        except httpx.HTTPError as exc:
            with self._cond:
                worker.last_error = f"reload: {type(exc).__name__}: {exc}"
                self._event(worker, WorkerStatus.DEAD, worker.last_error)
            return None

    def _await_version(self, worker: _Worker, *, version: int) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                health = self._http.get(f"{worker.url}/health", timeout=3.0).json()
            except (httpx.HTTPError, ValueError):
                health = {}
            if health.get("status") == "ok" and health.get("policy_version") == version:
                with self._cond:
                    worker.policy_version = health["policy_version"]
                    worker.failures = 0
                    if worker.status == WorkerStatus.LOADING:
                        self._event(worker, WorkerStatus.ACTIVE, f"now v{worker.policy_version}")
                    self._cond.notify_all()
                return
            time.sleep(0.1)
        with self._cond:
            worker.last_error = f"did not report v{version} within 60 s of its reload"
            self._event(worker, WorkerStatus.SUSPECT, worker.last_error)


def normalize_url(url: str) -> str:
    """A worker's base URL as the router keys it; ValueError unless http:// or https://."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker url must start with http:// or https://, got {url!r}")
    return url


def _json_or_error(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    return error_body(response.status_code, response.text[:500])


def _error_reply(status: int, message: str, worker: str = "") -> UpstreamReply:
    return UpstreamReply(status, error_body(status, message), worker)


def weight_server_reaches(server_host: str, worker_url: str) -> bool:
    """Whether a worker can reach the trainer's weight server: one on a loopback address
    (the default, DARTBOARD_WEIGHT_SERVER) only from a worker the router reaches on loopback
    too, on the same host; a worker elsewhere loads the checkpoint instead of waiting out a
    connection to its own loopback."""
    if not _loopback(server_host):
        return True
    return _loopback(urlsplit(worker_url).hostname or "")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"
