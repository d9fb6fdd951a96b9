"""Every refusal of the API as JSON a script can act on:

    {"code": "invalid_config", "message": "trainer.lr: must be > 0, got -1.0",
     "field": "trainer.lr", "errors": [{"code": ..., "message": ..., "field": ...}, ...]}

`code` is stable (documented in docs/scripting.md), `message` says what to do, `field` is the
setting or parameter concerned (null when none), and `errors` lists every problem found,
the first one repeated at the top.
"""

from __future__ import annotations

from typing import Any

import yaml
from django.db import DataError
from django.http import Http404, HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, parsers, status
from rest_framework.response import Response

from datamanager.config import ConfigInvalid


class ApiError(exceptions.APIException):
    """A refusal with its own code and field, e.g. ApiError(409, "conflict", "...")."""

    def __init__(self, status_code: int, code: str, message: str, field: str | None = None):
        super().__init__(message, code)
        self.status_code = status_code
        self.code = code
        self.field = field


def problem(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "field": field or None}


def body(problems: list[dict[str, Any]]) -> dict[str, Any]:
    return {**problems[0], "errors": problems}


def config_problems(exc: ConfigInvalid) -> list[dict[str, Any]]:
    return [problem("invalid_config", str(p), p.path) for p in exc.problems]


def _flatten(detail: Any, field: str = "") -> list[dict[str, Any]]:
    """DRF's nested validation detail as problems, each with its dotted field."""
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            name = "" if key == "non_field_errors" else str(key)
            out += _flatten(value, f"{field}.{name}".strip(".") if name else field)
        return out
    if isinstance(detail, list):
        return [p for item in detail for p in _flatten(item, field)]
    message = str(detail)
    return [problem("invalid", f"{field}: {message}" if field else message, field)]


_CODES = {
    exceptions.NotAuthenticated: "not_authenticated",
    exceptions.AuthenticationFailed: "not_authenticated",
    exceptions.PermissionDenied: "permission_denied",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.NotAcceptable: "not_acceptable",
    exceptions.ParseError: "parse_error",
    exceptions.Throttled: "throttled",
}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's EXCEPTION_HANDLER: every error the API raises, in the shape above."""
    headers: dict[str, str] = {}
    if isinstance(exc, ConfigInvalid):
        return Response(body(config_problems(exc)), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or "not found")
    if isinstance(exc, OverflowError | DataError):
        # An id or a filter past what the database stores (SQLite's 64 bits, PostgreSQL's
        # bigint): nothing could match it.
        exc = ApiError(400, "invalid", "a number in the request is out of range")
    if not isinstance(exc, exceptions.APIException):
        return None  # a bug: Django's 500 (logged), never a traceback in the reply
    if isinstance(exc, ApiError):
        problems = [problem(exc.code, str(exc.detail), exc.field)]
    elif isinstance(exc, exceptions.ValidationError):
        problems = _flatten(exc.detail) or [problem("invalid", "invalid input")]
    else:
        code = next((c for t, c in _CODES.items() if isinstance(exc, t)), str(exc.default_code))
        message = str(exc.detail)
        if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
            message = f"too many writes: try again in {int(exc.wait) + 1} s"
        problems = [problem(code, message)]
    if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
        headers["Retry-After"] = str(int(exc.wait) + 1)
    if auth := getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = auth
    return Response(body(problems), status=exc.status_code, headers=headers)


class YamlParser(parsers.BaseParser):
    """A request body in YAML (`Content-Type: application/yaml`), as a config file is."""

    media_type = "application/yaml"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return yaml.safe_load(stream.read().decode("utf-8"))
        except (UnicodeDecodeError, yaml.YAMLError) as exc:
            raise exceptions.ParseError(f"the body is not valid YAML: {exc}") from None


@csrf_exempt  # it changes nothing: a POST to a wrong path is a 404 as any other method's
def not_found(request: HttpRequest, rest: str = "") -> JsonResponse:
    """Any /api/ path that is no endpoint (the schema at /api/v1/schema/ lists them)."""
    message = f"no API endpoint {request.path}; the endpoints are in /api/v1/schema/"
    return JsonResponse(body([problem("not_found", message)]), status=404)
