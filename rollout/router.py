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
- POST /admin/sync {"checkpoint", "version", "run"?, "rolling"?, "weights"?}: weight sync in
  the background. Rolling (default), for each worker in turn: POST /v1/reload, wait until
  its /health reports the version. A worker that swaps live (its /health says
  `swaps_live`: the transformers server) goes on serving meanwhile; any other is drained
  first (no new requests routed, its in-flight ones finish) and active again after.
  rolling=false (the synchronous baseline) drains every such worker first, then reloads
  them all. `weights` {"host", "port", "tag", "key"}: the trainer's weight server holding
  the version (`training.weight_server`); workers that pull weights get it, and the
  checkpoint only when the pull fails. A server that took no connection is gone: every
  later reload loads the checkpoint until a sync names a server again. A newer sync supersedes an older one; within a run
  an older version than the target is refused (409); a new `run` starts its own version
  numbering.
- GET /health: {"status": "up"} or {"status": "down"} (an active worker or none), open to
  probes; with a token of the router, {"status", "workers", "target_version", "syncing",
  "active"};
  GET /admin/events: the status changes (for dashboards and tests); GET /v1/models: the
  models the live workers report.

Starlette on uvicorn (`rollout.asgi`): every route but GET /health needs a token: /admin/*
DARTBOARD_ADMIN_TOKEN, the inference routes DARTBOARD_INFERENCE_TOKEN (`rollout.auth`); the
router sends its workers the inference token, and the admin token with a reload; a sync
names a checkpoint under the checkpoint roots (`rollout.auth`); errors are OpenAI error
bodies with the field in `param`. The chat body is forwarded unread: the worker validates
it, and its 400 comes back as it is.

This module is the HTTP face and the command line; the worker table, the routing and the sync
are `rollout.router_state`, and `rollout.client.RouterAdmin` calls the admin routes. No Django
here: the router runs on inference hosts without the database.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import asdict
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from core.artifacts import ArtifactError, ArtifactRef, is_ref
from core.weight_wire import WeightSource, WireError
from rollout.asgi import (
    JSONReply,
    RequestError,
    TokenGate,
    bind,
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
    ROOTS_ENV,
    RequestRefused,
    ServiceTokens,
    check_token,
    checkpoint_allowed,
    checkpoint_roots,
    service_tokens,
)
from rollout.router_state import NoWorkerAvailable, Router, SyncRejected, normalize_url


def build_app(router: Router, *, tokens: ServiceTokens) -> TokenGate:
    """The ASGI app over `router` (module doc for the routes).

    Longer than a function should be for a reason: each route is a short closure over
    `router` and `tokens`, and keeping them together lets the route table at the end be read
    against the handlers above it.
    """

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
        weights = None
        if body.get("weights") is not None:
            try:
                weights = WeightSource.from_json(body["weights"], version=version)
            except WireError as exc:
                raise RequestError(str(exc), param="weights") from None
        try:
            state = router.request_sync(
                checkpoint=checkpoint, version=version, run=run, rolling=rolling, weights=weights
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
        return normalize_url(url)
    except ValueError as exc:
        raise RequestError(str(exc), param="url") from exc


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
