"""The inference router: least-loaded routing over several inference workers and a rolling,
one-worker-at-a-time weight sync, so rollout never stops globally when a policy is published.

Run (workers started first or later; an unreachable worker is probed until it answers):

    .venv/bin/python -m rollout.router --port 8100 --host 127.0.0.1 \\
        --worker http://127.0.0.1:8101 --worker http://127.0.0.1:8102 [--wait-timeout 60]

Endpoints:
- POST /v1/chat/completions: forwarded unchanged to the ACTIVE worker with the fewest
  requests in flight through this router (ties round-robin). A connection error or a
  502/503/504 takes the worker out of rotation and the request is retried on another; a 500
  is retried once on a different worker. With no active worker the request waits up to
  --wait-timeout seconds (or the `X-Dartboard-Timeout` header, if smaller), then gets 503.
  The reply adds `served_by` (the worker URL) and the `X-Dartboard-Worker` header, and
  `X-Dartboard-Upstream-Ms`: the time spent waiting on the worker, so a client can tell
  the router's own cost (bench/overhead.py).
- POST /admin/workers {"url"}: register; DELETE /admin/workers {"url"} (or ?url=): unregister;
  GET /admin/workers: [{url, status, in_flight, policy_version, served, ...}].
- POST /admin/sync {"checkpoint", "version", "run"?, "rolling"?}: weight sync in the
  background. Rolling (default), for each worker in turn: draining (no new requests
  routed), wait for its in-flight requests, POST /v1/reload, wait until its /health reports
  the version, active again. rolling=false (the synchronous baseline) drains every worker
  first, then reloads them all. A newer sync supersedes an older one; within a run an older
  version than the target is refused (409); a new `run` starts its own version numbering.
- GET /health: {"status": "up"} or {"status": "down"} (an active worker or none), open to
  probes; with a token of the router, {"status", "workers", "target_version", "syncing",
  "active"};
  GET /admin/events: the status changes (for dashboards and tests); GET /v1/models: the
  models the live workers report.

Starlette on uvicorn (`rollout.asgi`): every route but GET /health needs a token: /admin/*
DARTBOARD_ADMIN_TOKEN, the inference routes DARTBOARD_INFERENCE_TOKEN (`rollout.auth`); the
router sends its workers the inference token, and the admin token with a reload; a sync
names a checkpoint under the checkpoint roots (`rollout.auth`); errors are OpenAI error bodies with the field in `param`. The chat body is
forwarded unread: the worker validates it, and its 400 comes back as it is.

Worker statuses: active (routed), stale (healthy but behind the target version, waiting for
its reload), draining, loading, suspect (answered 503 or timed out), dead (refused the
connection). A background prober polls every worker's /health and brings suspect and dead
workers back. No Django here: the router runs on inference hosts without the database.
"""

from __future__ import annotations

import argparse
import collections
import logging
import math
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from core.artifacts import ArtifactError, ArtifactRef, is_ref
from rollout.asgi import (
    JSONReply,
    RequestError,
    TokenGate,
    bind,
    error_body,
    error_reply,
    json_object,
    model_card,
    read_body,
    run_blocking,
    serve,
    service_app,
    threads_lifespan,
)
from rollout.auth import (
    ADMIN_ENV,
    ROOTS_ENV,
    RequestRefused,
    ServiceTokens,
    bearer,
    check_token,
    checkpoint_allowed,
    checkpoint_roots,
    client_token,
    service_tokens,
)

log = logging.getLogger("rollout.router")

ROUTABLE = "active"
RETRY_ELSEWHERE = frozenset({502, 503, 504})
# A worker whose reload failed because its artifact store did not answer (503) is given the
# version again this much later; any other failed reload is not retried for that version.
RELOAD_RETRY_S = 5.0


class NoWorkerAvailable(Exception):
    """No active worker appeared within the wait bound; the message says what to do."""


class SyncRejected(ValueError):
    """A sync request that would move the policy backwards or names no checkpoint."""


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as GET /admin/workers reports it."""

    url: str
    status: str
    in_flight: int
    policy_version: int | None
    served: int
    failures: int
    last_error: str


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
    status: str = "dead"
    in_flight: int = 0
    policy_version: int | None = None
    served: int = 0
    failures: int = 0  # consecutive probe/forward failures
    last_error: str = ""
    failed_version: int | None = None  # a reload to this version failed: do not retry it
    retry_reload_at: float = 0.0  # its store was unreachable: retry no sooner (monotonic)
    loaded_run: int | None = None  # the run whose checkpoint the router loaded here (None: unknown)
    model: str = ""  # the name its /health reports

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
        url = _normalize_url(url)
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
            worker = self._workers.pop(_normalize_url(url), None)
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
            live = [w for w in self._workers.values() if w.status != "dead" and w.model]
            return sorted({w.model for w in live})

    def health(self) -> dict[str, Any]:
        with self._cond:
            active = sum(w.status == ROUTABLE for w in self._workers.values())
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

    def _event(self, worker: _Worker, status: str, detail: str = "") -> None:
        """Record a status change. Caller holds _cond."""
        if status not in ("registered", "unregistered"):
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
                self._release(worker, failed=f"timed out: {exc}", status="suspect")
                if time.monotonic() >= deadline:
                    return _error_reply(504, f"no reply within {total:g} s", worker.url)
                continue
            except httpx.HTTPError as exc:
                self._release(worker, failed=f"{type(exc).__name__}: {exc}", status="dead")
                continue
            if response.status_code in RETRY_ELSEWHERE:
                self._release(worker, failed=f"answered {response.status_code}", status="suspect")
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
                active = [w for w in self._workers.values() if w.status == ROUTABLE]
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
        self, worker: _Worker, *, served: bool = False, failed: str = "", status: str = ""
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
                if status == "dead" or worker.status == ROUTABLE:
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
                "draining",
                "loading",
            ):
                return
            if health is None:
                worker.failures += 1
                worker.last_error = error
                refused = "ConnectError" in error
                if refused or worker.failures >= 3:
                    self._event(worker, "dead", error)
                elif worker.status == ROUTABLE:
                    self._event(worker, "suspect", error)
                return
            worker.failures = 0
            if isinstance(health.get("model"), str):
                worker.model = health["model"]
            if isinstance(health.get("policy_version"), int):
                worker.policy_version = health["policy_version"]
            if health.get("status", "ok") != "ok":
                self._event(worker, "suspect", f"worker reports {health.get('status')}")
            elif worker.status != ROUTABLE and self._needs_reload(worker):
                # Only a worker coming (back) into service waits for its reload; an active
                # one behind the target keeps serving until the rolling sync reaches it.
                self._event(worker, "stale", f"behind target v{self.target_version}")
            else:
                self._event(worker, ROUTABLE)
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
        self, *, checkpoint: str, version: int, run: int | None = None, rolling: bool = True
    ) -> dict[str, Any]:
        """Set the target version; the sync thread rolls it out (module doc). Non-blocking.

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
            self.rolling = rolling
            self.syncing = any(self._needs_reload(w) for w in self._workers.values())
            self._cond.notify_all()
            return {
                "target_version": version,
                "run": self.target_run,
                "checkpoint": checkpoint,
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
                batch = (
                    [worker]
                    if rolling
                    else [
                        w
                        for w in self._workers.values()
                        if w.status in (ROUTABLE, "stale") and self._needs_reload(w)
                    ]
                )
            assert checkpoint is not None and version is not None
            # Rolling: one worker drains and reloads while the others serve. All at once (the
            # synchronous baseline): every worker drains first, then all reload.
            drained = [w for w in batch if self._drain(w, version=version)]
            for w in drained:
                self._reload(w, checkpoint=checkpoint, version=version)

    def _next_to_sync(self) -> _Worker | None:
        """A worker behind the target: idle stale ones first, then the least-loaded active.
        Caller holds _cond."""
        behind = [w for w in self._workers.values() if w.status in (ROUTABLE, "stale")]
        behind = [w for w in behind if self._needs_reload(w)]
        if not behind:
            return None
        return min(behind, key=lambda w: (w.status == ROUTABLE, w.in_flight))

    def _drain(self, worker: _Worker, *, version: int) -> bool:
        """Stop routing to `worker` and wait for its in-flight requests. True when drained."""
        with self._cond:
            self._event(worker, "draining", f"for v{version}")
            drained = self._cond.wait_for(
                lambda: worker.in_flight == 0 or self._stop.is_set(),
                timeout=self.request_timeout + 5,
            )
            if self._stop.is_set():
                return False
            if not drained or worker.status != "draining":  # died (or vanished) meanwhile
                if worker.status == "draining":
                    self._event(worker, "suspect", "in-flight requests never finished")
                return False
            return True

    def _reload(self, worker: _Worker, *, checkpoint: str, version: int) -> None:
        """Load `version` on a drained worker, wait for it to report it, reactivate it."""
        with self._cond:
            self._event(worker, "loading", f"v{version} from {checkpoint}")
            run = self.target_run
        started = time.monotonic()
        try:
            response = self._http.post(
                f"{worker.url}/v1/reload",
                json={"checkpoint": checkpoint, "version": version},
                headers=self._admin,
                timeout=self.reload_timeout,
            )
        except httpx.HTTPError as exc:
            with self._cond:
                worker.last_error = f"reload: {type(exc).__name__}: {exc}"
                self._event(worker, "dead", worker.last_error)
            return
        if response.status_code not in (200, 409):  # 409: a reload already runs there
            with self._cond:
                if response.status_code == 503:  # its artifact store did not answer: later
                    worker.retry_reload_at = time.monotonic() + RELOAD_RETRY_S
                else:
                    worker.failed_version = version
                worker.last_error = f"reload to v{version} failed: {_json_or_error(response)}"
                # It kept its old weights and still serves; the error is on the worker row.
                self._event(worker, "suspect", worker.last_error)
            return
        with self._cond:
            worker.loaded_run = run
        self._await_version(worker, version=version)
        log.info("%s reached v%d in %.1f s", worker.url, version, time.monotonic() - started)

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
                    if worker.status == "loading":
                        self._event(worker, ROUTABLE, f"now v{worker.policy_version}")
                    self._cond.notify_all()
                return
            time.sleep(0.1)
        with self._cond:
            worker.last_error = f"did not report v{version} within 60 s of its reload"
            self._event(worker, "suspect", worker.last_error)


def _normalize_url(url: str) -> str:
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


def build_app(router: Router, *, tokens: ServiceTokens) -> TokenGate:
    """The ASGI app over `router` (module doc for the routes)."""

    async def health(http: Request) -> Response:
        # Open to probes and load balancers, so it says up or down and nothing else; worker
        # URLs, their errors and versions go to a caller holding one of the router's tokens.
        authorization = http.headers.get("authorization")
        for token in (tokens.admin, tokens.inference):
            try:
                check_token(authorization, token)
            except RequestRefused:
                continue
            return JSONReply(router.health())
        return JSONReply({"status": "up" if router.health()["active"] else "down"})

    async def models(_: Request) -> Response:
        return JSONReply({"object": "list", "data": [model_card(m) for m in router.models()]})

    async def chat(http: Request) -> Response:
        timeout = _timeout_header(http.headers.get("X-Dartboard-Timeout"))
        body = await read_body(http)
        try:
            reply = await run_blocking(router.complete, body, timeout=timeout)
        except NoWorkerAvailable as exc:
            return error_reply(503, str(exc), headers={"Retry-After": "1"})
        headers = {
            "X-Dartboard-Worker": reply.worker,
            "X-Dartboard-Upstream-Ms": f"{reply.upstream_ms:.3f}",
        }
        return JSONReply(reply.body, reply.status, headers=headers)

    async def workers(_: Request) -> Response:
        return JSONReply([asdict(w) for w in router.workers()])

    async def register(http: Request) -> Response:
        url = _url_field(await json_object(http))
        return JSONReply(asdict(await run_blocking(router.register, url)))

    async def unregister(http: Request) -> Response:
        url = http.query_params.get("url") or _url_field(await json_object(http))
        if not router.unregister(url):
            return error_reply(404, f"worker {url} is not registered", param="url")
        return JSONReply({"unregistered": url})

    async def sync(http: Request) -> Response:
        body = await json_object(http)
        checkpoint, version = body.get("checkpoint"), body.get("version")
        if not isinstance(checkpoint, str) or not checkpoint:
            raise RequestError("checkpoint must be a directory path string", param="checkpoint")
        if is_ref(checkpoint):  # fetched and verified by each worker from the store
            try:
                ArtifactRef.parse(checkpoint)
            except ArtifactError as exc:
                raise RequestError(str(exc), param="checkpoint") from None
        elif router.roots:  # else the workers check their own roots
            checkpoint_allowed(checkpoint, router.roots)
        if not isinstance(version, int) or isinstance(version, bool):
            raise RequestError("version must be an integer", param="version")
        run, rolling = body.get("run"), body.get("rolling", True)
        if run is not None and (not isinstance(run, int) or isinstance(run, bool)):
            raise RequestError("run must be an integer (or left out)", param="run")
        if not isinstance(rolling, bool):
            raise RequestError("rolling must be true or false", param="rolling")
        try:
            state = router.request_sync(
                checkpoint=checkpoint, version=version, run=run, rolling=rolling
            )
        except SyncRejected as exc:
            return error_reply(409, str(exc), param="version")
        return JSONReply(state, 202)

    async def events(_: Request) -> Response:
        return JSONReply(router.events())

    return service_app(
        [
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/admin/workers", workers, methods=["GET"]),
            Route("/admin/workers", register, methods=["POST"]),
            Route("/admin/workers", unregister, methods=["DELETE"]),
            Route("/admin/sync", sync, methods=["POST"]),
            Route("/admin/events", events),
        ],
        tokens=tokens,
        lifespan=threads_lifespan(router.start, router.stop),
    )


def _timeout_header(value: str | None) -> float | None:
    """X-Dartboard-Timeout as seconds; nan made the wait loop spin, so only a finite positive
    number passes."""
    if not value:
        return None
    try:
        timeout = float(value)
    except ValueError:
        timeout = math.nan
    if not math.isfinite(timeout) or timeout <= 0:
        raise RequestError(
            f"X-Dartboard-Timeout must be a positive number of seconds, got {value!r}",
            param="X-Dartboard-Timeout",
        )
    return timeout


def _url_field(body: dict[str, Any]) -> str:
    url = body.get("url")
    if not isinstance(url, str) or not url:
        raise RequestError(
            "url must be the worker's base URL, e.g. http://127.0.0.1:8101", param="url"
        )
    try:
        return _normalize_url(url)
    except ValueError as exc:
        raise RequestError(str(exc), param="url") from exc


class RouterAdmin:
    """The admin API from Python (launcher, trainer):

    admin = RouterAdmin("http://127.0.0.1:8100")
    admin.register("http://127.0.0.1:8101")
    admin.sync("/path/to/checkpoint", 3)
    admin.wait_for_version(3, timeout=300)
    """

    def __init__(self, base_url: str, *, timeout: float = 30.0, token: str | None = None):
        """`token`: the admin token (default: DARTBOARD_ADMIN_TOKEN)."""
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(timeout=timeout, headers=bearer(client_token(token, ADMIN_ENV)))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RouterAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, f"{self.base_url}{path}", **kwargs)
        if response.status_code >= 400:
            message = _json_or_error(response).get("error", {}).get("message", response.text)
            raise RuntimeError(f"router answered {response.status_code}: {message}")
        return response.json()

    def register(self, url: str) -> WorkerInfo:
        return WorkerInfo(**self._call("POST", "/admin/workers", json={"url": url}))

    def unregister(self, url: str) -> None:
        self._call("DELETE", "/admin/workers", params={"url": url})

    def sync(
        self, checkpoint: str, version: int, *, run: int | None = None, rolling: bool = True
    ) -> dict[str, Any]:
        """Publish `version` (of `run`); returns at once, the rollout runs in the router."""
        body: dict[str, Any] = {
            "checkpoint": str(checkpoint),
            "version": version,
            "rolling": rolling,
        }
        if run is not None:
            body["run"] = run
        return self._call("POST", "/admin/sync", json=body)

    def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo(**w) for w in self._call("GET", "/admin/workers")]

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def wait_for_version(self, version: int, *, timeout: float = 300.0) -> list[WorkerInfo]:
        """Block until every live worker is active at `version` or newer."""
        deadline = time.monotonic() + timeout
        while True:
            workers = self.workers()
            live = [w for w in workers if w.status != "dead"]
            if live and all(
                w.status == ROUTABLE and (w.policy_version or 0) >= version for w in live
            ):
                return workers
            if time.monotonic() > deadline:
                states = ", ".join(f"{w.url} {w.status} v{w.policy_version}" for w in workers)
                raise TimeoutError(f"workers did not reach v{version} in {timeout:g} s: {states}")
            time.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.router", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--worker", action="append", default=[], help="worker base URL (repeatable)"
    )
    parser.add_argument(
        "--wait-timeout", type=float, default=60.0, help="seconds a request waits for a worker"
    )
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--probe-interval", type=float, default=1.0)
    parser.add_argument(
        "--checkpoint-root",
        action="append",
        default=[],
        help=f"a directory a sync may name (repeatable; else ${ROOTS_ENV})",
    )
    args = parser.parse_args(argv)
    tokens = service_tokens()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    router = Router(
        wait_timeout=args.wait_timeout,
        request_timeout=args.request_timeout,
        probe_interval=args.probe_interval,
        tokens=tokens,
        roots=checkpoint_roots(args.checkpoint_root, served=None),
    )
    sock = bind(args.host, args.port)
    for url in args.worker:
        router.register(url)
    print(
        f"routing on http://{args.host}:{sock.getsockname()[1]} over {len(args.worker)} worker(s)",
        file=sys.stderr,
        flush=True,
    )
    serve(build_app(router, tokens=tokens), sock)


if __name__ == "__main__":
    main()
