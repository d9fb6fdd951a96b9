"""The HTTP edge the inference server, the router and the vLLM adapter share: Starlette on
uvicorn, the service token at the door, capped and timed body reads, and OpenAI-shaped
errors.

- `service_app(routes, tokens=..., lifespan=...)` builds the Starlette app: every route but
  GET /health needs its purpose's token (`rollout.auth.ServiceTokens`: the admin token on
  /admin/* and /v1/reload, the inference token elsewhere); `RequestError` (a bad field: 400 with
  `param`) and `RequestRefused` (any status) raised in an endpoint become
  `{"error": {"message", "type", "param", "code"}}`, as do unknown routes and methods.
- `json_object(request)` reads at most MAX_BODY_BYTES within SOCKET_TIMEOUT_S and decodes a
  JSON object; a lying Content-Length is a 400 or 413 before a byte is read.
- `run_blocking(fn, *args)` runs blocking work (generation waits, forwarding, reloads) on a
  worker thread; the pool is widened in `serve()` so hundreds of waiting clients do not queue
  behind 40 threads.
- `bind(host, port)` then `serve(app, sock)`: bind first (port 0 picks a free one) so the
  caller knows its address, then run uvicorn until SIGTERM or SIGINT (graceful: the
  lifespan's shutdown stops the app's threads).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import anyio.to_thread
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout.auth import (
    MAX_BODY_BYTES,
    SOCKET_TIMEOUT_S,
    RequestRefused,
    ServiceTokens,
    check_token,
    content_length,
)

log = logging.getLogger("rollout.asgi")

T = TypeVar("T")
Endpoint = Callable[[Request], Awaitable[Response]]
OPEN_PATHS = frozenset({"/health"})  # probes and load balancers call it without the token
THREADS = 1024  # blocking requests served at once (each waits on a generation or a worker)


class RequestError(ValueError):
    """A malformed request; `param` names the offending field (a 400); `code`, when given,
    says which refusal it is (`rollout.client.PROMPT_TOO_LONG`)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class JSONReply(Response):
    """JSON without Starlette's allow_nan=False: a NaN entropy must not turn a finished
    generation into a 500 (Python's and the openai client's json read NaN)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape; `code` carries the refusal's code, else the HTTP status."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def error_reply(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONReply:
    return JSONReply(error_body(status, message, param, code), status_code=status, headers=headers)


def model_card(name: str) -> dict[str, Any]:
    """One entry of GET /v1/models, as OpenAI lists a model."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "dartboard"}


async def json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object body (an empty body is {})."""
    raw = await read_body(request)
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


async def read_body(request: Request) -> bytes:
    """The raw body, refused (RequestRefused) when it is or grows past MAX_BODY_BYTES or
    does not arrive within SOCKET_TIMEOUT_S."""
    content_length(request.headers.get("content-length"))  # a lying header: refused unread
    chunks: list[bytes] = []

    async def collect() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:  # chunked bodies declare no length
                raise RequestRefused(413, f"body past {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), SOCKET_TIMEOUT_S)
    except TimeoutError:
        raise RequestRefused(
            408, f"the body did not arrive within {SOCKET_TIMEOUT_S:g} s"
        ) from None
    return b"".join(chunks)


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


class TokenGate:
    """ASGI middleware: 401 before routing unless the request carries the token of the
    route's purpose. The connection is closed, so an unread body cannot be taken for the
    next request. The header's raw bytes are compared (any byte is a clean 401)."""

    def __init__(self, app: ASGIApp, *, tokens: ServiceTokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                check_token(authorization, self.tokens.for_path(scope["path"]))
            except RequestRefused as exc:
                reply = error_reply(exc.status, str(exc), headers={"Connection": "close"})
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestRefused)
    # A refused body may be unread: close rather than parse it as the next request.
    return error_reply(exc.status, str(exc), param=exc.param, headers={"Connection": "close"})


async def _bad_field(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return error_reply(400, str(exc), param=exc.param, code=exc.code)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = (
        f"no route {request.method} {request.url.path}"
        if exc.status_code in (404, 405)
        else str(exc.detail)
    )
    return error_reply(exc.status_code, message)


def service_app(
    routes: Sequence[BaseRoute],
    *,
    tokens: ServiceTokens,
    lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]] | None = None,
) -> TokenGate:
    app = Starlette(
        routes=list(routes),
        lifespan=lifespan,
        exception_handlers={
            RequestRefused: _refused,
            RequestError: _bad_field,
            HTTPException: _http_error,
        },
    )
    return TokenGate(app, tokens=tokens)


def worker_app(
    endpoints: tuple[Endpoint, Endpoint, Endpoint, Endpoint],
    *,
    tokens: ServiceTokens,
    threads: tuple[Callable[[], None], Callable[[], None]],
) -> TokenGate:
    """The inference-worker contract (the transformers server and the vLLM adapter serve the
    same routes): `endpoints` are /health, /v1/models, /v1/chat/completions and /v1/reload;
    `threads` start and stop the app's own threads with the server."""
    health, models, chat, reload = endpoints
    return service_app(
        [
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/reload", reload, methods=["POST"]),
        ],
        tokens=tokens,
        lifespan=threads_lifespan(*threads),
    )


def threads_lifespan(
    start: Callable[[], None], stop: Callable[[], None]
) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """A lifespan that starts the app's own threads with the server and stops them after."""

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        start()
        try:
            yield
        finally:
            await run_blocking(stop)

    return lifespan


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: a free port); IPv6 hosts work too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when
    # the socket says it is TCP. Without it, uvicorn's headers and body (two writes) waited
    # for the client's delayed ACK: 44 ms per request (bench/overhead.py).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def serve(app: ASGIApp, sock: socket.socket) -> None:
    """Run uvicorn on a bound socket until SIGTERM or SIGINT."""
    config = uvicorn.Config(
        app,
        http="h11",
        lifespan="on",
        log_level="warning",
        access_log=False,
        # Clients keep connections in a pool: close idle ones late, as http.server did.
        timeout_keep_alive=int(SOCKET_TIMEOUT_S),
        timeout_graceful_shutdown=10,
        server_header=False,
    )
    uvicorn.Server(config).run(sockets=[sock])
