"""A database outage answered as one: 503 with what is down, not a bare 500.

While the database is away every page fails (the session and the user are read from it), in
whichever middleware first touches it. Django turns that exception into a 500 response and
signals `got_request_exception` first; the handler below marks the request, and the
outermost middleware swaps the 500 for a 503 that names the error, lists what the health
probes see (dartboard/health.py) and reloads itself. JSON callers (the run page's health
poll) get the same as JSON, so the page's banner says the database is down.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from django.core.signals import got_request_exception
from django.db.utils import InterfaceError, OperationalError
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.html import escape

from dartboard import health

_MARK = "_dartboard_database_error"


@receiver(got_request_exception)
def _mark_database_errors(sender: object, request: HttpRequest | None = None, **kwargs) -> None:
    exc = sys.exc_info()[1]
    if request is not None and isinstance(exc, (OperationalError, InterfaceError)):
        setattr(request, _MARK, exc)


class DatabaseOutageMiddleware:
    """Outermost middleware (settings.MIDDLEWARE[0])."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        exc = getattr(request, _MARK, None)
        if exc is None:
            return response
        return outage_response(request, exc)


def outage_response(request: HttpRequest, exc: BaseException) -> HttpResponse:
    error = f"the database is unreachable: {type(exc).__name__}: {str(exc).strip()}"
    services = health.BOARD.services()
    banner = health.outage_banner(services) or f"Outage: {error}"
    wants_json = request.path.endswith(".json") or "json" in request.headers.get("Accept", "")
    if wants_json:
        body = {"outage": error, "banner": banner, "services": [s.as_json() for s in services]}
        return JsonResponse(body, status=503, headers={"Retry-After": "5"})
    rows = "".join(
        f"<li>{escape(s.label)}: {escape(s.state)}"
        f"{' - ' + escape(s.last_error) if s.state != health.UP and s.last_error else ''}</li>"
        for s in services
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' "
        "content='5'><title>Dartboard: outage</title></head><body>"
        f"<h1>Dartboard cannot reach its database</h1><p role='alert'>{escape(banner)}</p>"
        f"<ul>{rows}</ul><p>Workers retry by themselves and nothing that finished is lost; "
        "this page reloads every 5 s.</p></body></html>"
    )
    return HttpResponse(page, status=503, headers={"Retry-After": "5"})
