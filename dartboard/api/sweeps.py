"""Sweeps: a config over a grid of settings and seeds, each member its own run, started one
(or `parallel`) at a time as earlier ones end (`datamanager.services.sweeps`)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from dartboard.api import schemas
from dartboard.api.base import ApiView, get_or_404, page_of, query_of
from dartboard.api.errors import ApiError
from dartboard.api.runs import with_overrides
from datamanager.models import Sweep
from datamanager.roles import CAN_CREATE
from datamanager.selectors.accounts import sweeps_listing
from datamanager.services.runs import NotYourRun
from datamanager.services.sweeps import sweep_advance, sweep_create, sweep_stop

ERRORS = schemas.ERRORS


def sweeps_queryset():
    return sweeps_listing()


class SweepsView(ApiView):
    write_permission = CAN_CREATE

    @extend_schema(
        operation_id="sweeps_list",
        parameters=[schemas.Page],
        responses={200: schemas.SweepListOut, **ERRORS},
    )
    def get(self, request: Request) -> Response:
        """Sweeps, newest first, with their members."""
        count, page = page_of(sweeps_queryset(), query_of(request, schemas.Page))
        return Response({"count": count, "results": schemas.SweepOut(page, many=True).data})

    @extend_schema(
        operation_id="sweeps_create",
        request={
            "application/json": schemas.SweepCreate,
            "application/yaml": schemas.SweepCreate,
        },
        responses={201: schemas.SweepOut, **ERRORS},
    )
    def post(self, request: Request) -> Response:
        """Create a sweep's runs (each member checked as the run form checks a run, every
        problem at once) and start the first `parallel` of them; the next start as those
        end."""
        body = schemas.SweepCreate(data=request.data)
        body.is_valid(raise_exception=True)
        d = body.validated_data
        config = with_overrides(d["config"], d["overrides"])
        sweep = sweep_create(
            name=d["name"],
            config=config,
            grid=d["grid"],
            seeds=d["seeds"],
            parallel=d["parallel"],
            owner=request.user,
        )
        sweep_advance(sweep_id=sweep.pk)
        return Response(
            schemas.SweepOut(sweeps_queryset().get(pk=sweep.pk)).data,
            status=status.HTTP_201_CREATED,
        )


class SweepView(ApiView):
    @extend_schema(
        operation_id="sweeps_read",
        responses={200: schemas.SweepOut, 404: schemas.ErrorOut, **ERRORS},
    )
    def get(self, request: Request, sweep_id: int) -> Response:
        """A sweep with its members' runs and their status."""
        return Response(schemas.SweepOut(get_or_404(sweeps_queryset(), "sweep", pk=sweep_id)).data)


class SweepStopView(ApiView):
    @extend_schema(
        operation_id="sweeps_stop",
        request=None,
        responses={200: schemas.SweepOut, 404: schemas.ErrorOut, **ERRORS},
    )
    def post(self, request: Request, sweep_id: int) -> Response:
        """Stop a sweep: its active members stop, the others never start."""
        get_or_404(Sweep, "sweep", pk=sweep_id)
        try:
            sweep_stop(sweep_id=sweep_id, user=request.user)
        except NotYourRun as exc:
            raise ApiError(403, "not_your_run", str(exc)) from None
        return Response(schemas.SweepOut(sweeps_queryset().get(pk=sweep_id)).data)
