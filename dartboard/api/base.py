"""What every endpoint shares: the view base class (outside the dashboard's login redirect:
the API answers 401 itself), its query parameters parsed, a page of a queryset, and the
services' refusals as API errors."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.auth.decorators import login_not_required
from django.db.models import Model, QuerySet
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.views import APIView

from dartboard.api.errors import ApiError
from datamanager.roles import CAN_CONTROL


class ApiView(APIView):
    # An API endpoint: reads need the viewer role, writes `write_permission`. (No docstring:
    # the schema would give it to every endpoint without one of its own.)

    write_permission = CAN_CONTROL

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Any:
        return login_not_required(super().as_view(**initkwargs))


def query_of(
    request: Request, query: type[serializers.Serializer], *, also: Iterable[str] = ()
) -> dict[str, Any]:
    """The query parameters as `query` (the serializer the endpoint's schema states them
    from) parses them; a parameter neither it nor `also` knows, or an empty one, refused."""
    known_params(request, {*query().fields, *also})
    parsed = query(data=request.query_params)
    parsed.is_valid(raise_exception=True)
    return dict(parsed.validated_data)


def page_of(qs: QuerySet, query: dict[str, Any]) -> tuple[int, QuerySet]:
    """(count, the page a parsed query's `limit` and `offset` ask for: `schemas.Page`)."""
    limit, offset = query["limit"], query["offset"]
    return qs.count(), qs[offset : offset + limit]


def known_params(request: Request, allowed: set[str]) -> None:
    """Refuse a query parameter the endpoint does not know, or an empty one: either would
    otherwise widen the answer silently (`?statu=failed` listing everything)."""
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise ApiError(
            400,
            "invalid",
            f"unknown parameter {unknown[0]!r}; known: {', '.join(sorted(allowed)) or 'none'}",
            unknown[0],
        )
    # An empty value is refused too: a script's empty variable must not mean "any".
    empty = sorted(k for k, values in request.query_params.lists() if "" in values)
    if empty:
        raise ApiError(
            400, "invalid", f"{empty[0]} is empty: give a value or leave it out", empty[0]
        )


def get_or_404(qs: QuerySet | type[Model], what: str, **lookup: Any) -> Any:
    manager = qs._default_manager if isinstance(qs, type) else qs
    found = manager.filter(**lookup).first()
    if found is None:
        raise ApiError(404, "not_found", f"no {what} {next(iter(lookup.values()))}")
    return found
