"""What the rollout service's HTTP servers (inference server, router, vLLM adapter) demand of
a request: the service token, a sane body, and checkpoint paths under configured roots.

- Every route but GET /health needs `Authorization: Bearer <token>`. The token comes from
  DARTBOARD_SERVICE_TOKEN (the launcher and compose pass it; locally it is generated once
  into DARTBOARD_HOME/service_token) or a --token-file; a server without one refuses to
  start. Clients (`PolicyClient`, `RouterAdmin`) send it.
- A body is at most MAX_BODY_BYTES, with a valid Content-Length; sockets time out.
- A reload or sync loads weights only from a directory under one of the checkpoint roots
  (DARTBOARD_CHECKPOINT_ROOTS, os.pathsep-separated, or --checkpoint-root; by default the
  directory holding the served policy).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

TOKEN_ENV = "DARTBOARD_SERVICE_TOKEN"
ROOTS_ENV = "DARTBOARD_CHECKPOINT_ROOTS"
MAX_BODY_BYTES = 64 * 1024 * 1024  # five 1920x1080 screenshots as base64 PNG fit many times
SOCKET_TIMEOUT_S = 120.0  # a client that stops sending mid-request is dropped


class RequestRefused(Exception):
    """A request the server will not serve: `status` and an exact message."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def service_token(token_file: str | None = None) -> str:
    """The token a server demands; raises SystemExit with the fix when there is none."""
    token = Path(token_file).read_text().strip() if token_file else os.environ.get(TOKEN_ENV, "")
    if len(token.strip()) < 16:
        raise SystemExit(
            f"no service token: set {TOKEN_ENV} (at least 16 characters; `make run` passes the "
            "one in DARTBOARD_HOME/service_token) or give --token-file"
        )
    return token.strip()


def client_token(token: str | None) -> str | None:
    """A client's token: the one given, else DARTBOARD_SERVICE_TOKEN."""
    return token or os.environ.get(TOKEN_ENV) or None


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_token(authorization: str | None, token: str) -> None:
    """Raise RequestRefused(401) unless the header carries the service token."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
        raise RequestRefused(
            401, "missing or wrong service token (send Authorization: Bearer <token>)"
        )


def content_length(value: str | None) -> int:
    """The body length a request declares, checked against MAX_BODY_BYTES."""
    if value is None or value == "":
        return 0
    try:
        length = int(value)
    except ValueError:
        raise RequestRefused(400, f"Content-Length {value!r} is not an integer") from None
    if length < 0:
        raise RequestRefused(400, f"Content-Length {length} is negative")
    if length > MAX_BODY_BYTES:
        raise RequestRefused(413, f"body of {length} bytes; at most {MAX_BODY_BYTES}")
    return length


def checkpoint_roots(extra: list[str], *, served: str | None) -> list[Path]:
    """The roots a reload may load from: --checkpoint-root values and ROOTS_ENV, else the
    directory holding the served policy."""
    roots = [*extra, *[r for r in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if r]]
    if not roots and served:
        roots = [str(Path(served).resolve().parent)]
    return [Path(r).resolve() for r in roots]


def checkpoint_allowed(path: str, roots: list[Path]) -> Path:
    """The resolved checkpoint directory when it lies under a root; RequestRefused(403)
    otherwise (symlinks resolved first, so a link cannot lead out of a root)."""
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots) or "(none configured)"
        raise RequestRefused(
            403,
            f"checkpoint {path} is outside the checkpoint roots ({allowed})",
            param="checkpoint",
        )
    return resolved
