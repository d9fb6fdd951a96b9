"""Flower, the Celery monitor, behind the dashboard's login: the web serves /flower/ to admins
(the view in dartboard/views.py) by passing each request on to the Flower process at
DARTBOARD_FLOWER_URL (`make flower`: 127.0.0.1:5555; docker-compose: the `flower` service)
with Flower's own basic-auth login. Nobody types that login: it stays between the web and
Flower, so a direct connection to Flower (from another container, say) still needs it.

Flower's API runs any Celery task, so the dashboard's session cookie and the user's own
Authorization never reach it, and an unsafe request must come from the dashboard's own
pages (`same_origin`), as Flower itself checks when it is reached directly.
"""

from __future__ import annotations

import base64
import os
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.http import HttpRequest

# What goes on to Flower of a request, and what comes back of its reply; everything else
# (cookies, Authorization, hop-by-hop headers, Flower's own cookies) stays behind.
REQUEST_HEADERS = ("Accept", "Accept-Language", "Content-Type", "X-Requested-With")
REPLY_HEADERS = ("Content-Type", "Cache-Control", "Content-Disposition", "Location", "Etag")
TIMEOUT_S = 30.0


def flower_login() -> str:
    """user:password from FLOWER_BASIC_AUTH, else ops and the password kept in the home
    (generated on first use, readable by its owner only)."""
    given = os.environ.get("FLOWER_BASIC_AUTH", "").strip()
    if given:
        return given
    path = settings.DARTBOARD_HOME / "flower_password"
    if not path.exists():  # readable by its owner only from the first byte
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(18))
    return f"ops:{path.read_text().strip()}"


@dataclass(frozen=True)
class FlowerReply:
    status: int
    body: bytes
    headers: list[tuple[str, str]]


def same_origin(request: HttpRequest) -> bool:
    """Whether a browser sent `request` from the dashboard's own pages: Fetch Metadata
    says same-origin, or (a browser without it) the Origin header names this host."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None:
        return site == "same-origin"
    origin = request.headers.get("Origin")
    return origin is not None and urlsplit(origin).netloc == request.get_host()


def forward(request: HttpRequest) -> FlowerReply:
    """`request` sent on to Flower (same path and query, Flower serves under /flower/)."""
    login = base64.b64encode(flower_login().encode()).decode()
    headers = {name: request.headers[name] for name in REQUEST_HEADERS if name in request.headers}
    headers["Authorization"] = f"Basic {login}"
    url = settings.DARTBOARD_FLOWER_URL.rstrip("/") + request.get_full_path()
    try:
        reply = httpx.request(
            request.method or "GET",
            url,
            headers=headers,
            content=request.body,
            timeout=TIMEOUT_S,
            follow_redirects=False,
        )
    except httpx.HTTPError as exc:
        message = (
            f"Flower does not answer at {settings.DARTBOARD_FLOWER_URL} ({type(exc).__name__}); "
            "start it with `make flower`"
        )
        return FlowerReply(502, message.encode(), [("Content-Type", "text/plain")])
    kept = [(name, reply.headers[name]) for name in REPLY_HEADERS if name in reply.headers]
    base = settings.DARTBOARD_FLOWER_URL.rstrip("/")
    kept = [  # a redirect stays on the dashboard (Flower's address is not the browser's)
        (name, value.removeprefix(base) if name == "Location" else value) for name, value in kept
    ]
    return FlowerReply(reply.status_code, reply.content, kept)
