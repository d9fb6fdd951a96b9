"""Request body limits, enforced while the body streams in: ASGI middleware around Django.

Django's ASGI handler reads a request's whole body into a temporary file before any view
runs, so a size check in a form (the upload's) comes after the disk has taken all of it.
`BodyLimit` counts the body as the server hands it on and refuses a body past its path's
limit with 413: at once, nothing read, when Content-Length declares too much; else as soon as
the bytes received pass the limit (a chunked body), and Django, told the client left, drops
what it spooled (never more than the limit). The demonstration upload may carry
MAX_UPLOAD_BYTES of .zip plus its form; every other request is a form or a JSON call.

This holds under a server that passes the body on as it arrives, as `dartboard.serve`
(uvicorn) does; daphne buffers a whole body before it calls the application, which is why the
web does not run on daphne (serve.py). In deployment the TLS proxy (deploy/Caddyfile,
request_body) also cuts a body at the edge, with the same limits.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from datamanager.archive import MAX_UPLOAD_BYTES

DEFAULT_MAX_BYTES = 10 * 2**20
FORM_SLACK_BYTES = 2**20  # multipart framing and the upload form's other fields
UPLOAD_PATH = "/trajectories/upload/"  # dartboard/urls.py, name "upload"
# The REST API takes settings and small bodies only; its refusal is JSON (dartboard/api).
API_PREFIX = "/api/"
API_MAX_BYTES = 2**20

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def path_limits() -> dict[str, int]:
    """The paths with a limit of their own."""
    return {UPLOAD_PATH: MAX_UPLOAD_BYTES + FORM_SLACK_BYTES}


class BodyLimit:
    def __init__(
        self, app: Any, *, default: int = DEFAULT_MAX_BYTES, paths: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.default = default
        self.paths = path_limits() if paths is None else paths

    def limit(self, path: str) -> int:
        if path.startswith(API_PREFIX):
            return self.paths.get(path, API_MAX_BYTES)
        return self.paths.get(path, self.default)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope["path"])
        declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await _refuse(send, limit, scope["path"])
            return
        received = 0
        refused = False

        async def counted() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Refused here; Django is told the client left, and stops reading.
                    refused = True
                    await _refuse(send, limit, scope["path"])
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, counted, send)


async def _refuse(send: Send, limit: int, path: str) -> None:
    message = f"Request body too large: at most {limit} bytes here."
    if path.startswith(API_PREFIX):  # the API's error shape (dartboard/api/errors.py)
        problem = {"code": "too_large", "message": message, "field": None}
        body, kind = json.dumps({**problem, "errors": [problem]}).encode(), b"application/json"
    else:
        body, kind = f"{message}\n".encode(), b"text/plain; charset=utf-8"
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", kind),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),  # the rest of the body is never read
            ],
            "trailers": False,
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
