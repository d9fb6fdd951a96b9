"""Runs: create from a config (JSON or YAML, with dotted overrides), list, read, control
(start, pause, resume, stop), copy, and a run's env slots. Each write is one service call,
recorded as the dashboard's are (`run_apply`'s RunAction: who, when, what came of it)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from dartboard.api import schemas
from dartboard.api.base import ApiView, get_or_404, page_of, query_of
from dartboard.api.errors import ApiError
from datamanager.config import config_override
from datamanager.models import Run
from datamanager.roles import CAN_CREATE
from datamanager.selectors.runs import current_slots, runs_listing
from datamanager.services import runs as services
from datamanager.services.run_workers import RunNotStartable, run_apply

ERRORS = schemas.ERRORS


def runs_queryset() -> QuerySet[Run]:
    return runs_listing()


def with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """`config` with each dotted override applied (`config_override`)."""
    if not isinstance(config, dict):
        return config  # run_config_validate says what is wrong with it
    for path, value in overrides.items():
        config = config_override(config, path, value)
    return config


def control(*, run_id: int, action: str, user: Any) -> Run:
    """`run_apply` with its refusals as API errors (each one recorded by it)."""
    get_or_404(Run, "run", pk=run_id)
    try:
        run_apply(run_id=run_id, action=action, user=user)
    except services.NotYourRun as exc:
        raise ApiError(403, "not_your_run", str(exc)) from None
    except services.InvalidTransition as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    except RunNotStartable as exc:
        raise ApiError(409, "not_startable", str(exc)) from None
    return runs_queryset().get(pk=run_id)


def create(*, name: str, config: Any, user: Any, start: bool) -> Run:
    """A run checked as the run form checks one, owned by `user`, started if asked."""
    cfg = services.run_config_validate(data=config, user=user)
    run = services.run_create(name=name, config=cfg, owner=user)
    if not start:
        return runs_queryset().get(pk=run.pk)
    try:
        return control(run_id=run.pk, action="start", user=user)
    except ApiError as exc:
        raise ApiError(
            exc.status_code, exc.code, f"run #{run.pk} was created; it cannot start: {exc.detail}"
        ) from None


class RunsView(ApiView):
    write_permission = CAN_CREATE

    @extend_schema(
        operation_id="runs_list",
        parameters=[schemas.RunsQuery],
        responses={200: schemas.RunListOut, **ERRORS},
    )
    def get(self, request: Request) -> Response:
        """Runs, newest first."""
        query = query_of(request, schemas.RunsQuery)
        qs = runs_queryset()
        if "status" in query:
            qs = qs.filter(status=query["status"])
        if "owner" in query:
            qs = qs.filter(owner__username=query["owner"])
        if "sweep" in query:
            qs = qs.filter(sweep_member__sweep_id=query["sweep"])
        count, page = page_of(qs, query)
        return Response({"count": count, "results": schemas.RunOut(page, many=True).data})

    @extend_schema(
        operation_id="runs_create",
        request={
            "application/json": schemas.RunCreate,
            "application/yaml": schemas.RunCreate,
        },
        responses={201: schemas.RunOut, 409: schemas.ErrorOut, **ERRORS},
    )
    def post(self, request: Request) -> Response:
        """Create a run from its settings (as the run form does: every problem at once),
        owned by you; `start` starts it too."""
        body = schemas.RunCreate(data=request.data)
        body.is_valid(raise_exception=True)
        d = body.validated_data
        run = create(
            name=d["name"],
            config=with_overrides(d["config"], d["overrides"]),
            user=request.user,
            start=d["start"],
        )
        return Response(schemas.RunOut(run).data, status=status.HTTP_201_CREATED)


class RunView(ApiView):
    @extend_schema(
        operation_id="runs_read", responses={200: schemas.RunOut, 404: schemas.ErrorOut, **ERRORS}
    )
    def get(self, request: Request, run_id: int) -> Response:
        """A run: its resolved settings, status, placement and why it waits."""
        return Response(schemas.RunOut(get_or_404(runs_queryset(), "run", pk=run_id)).data)


CONTROLS = {
    "start": "Start a run as its page's Start button does: queued while no host has room, "
    "with the reason; refused with it when it cannot start.",
    "pause": "Pause a running run: its env slots and trainer stop taking work.",
    "resume": "Resume a paused run.",
    "stop": "Stop a run; a queued one leaves the queue.",
}


class RunControlView(ApiView):
    action = "start"

    def control(self, request: Request, run_id: int) -> Response:
        return Response(
            schemas.RunOut(control(run_id=run_id, action=self.action, user=request.user)).data
        )


def control_view(action: str) -> Any:
    """The endpoint of one control action, recorded with who and when (RunAction)."""

    @extend_schema(
        operation_id=f"runs_{action}",
        description=CONTROLS[action],
        request=None,
        responses={200: schemas.RunOut, 404: schemas.ErrorOut, 409: schemas.ErrorOut, **ERRORS},
    )
    def post(self: RunControlView, request: Request, run_id: int) -> Response:
        return self.control(request, run_id)

    view: Any = type(
        f"Run{action.title()}View", (RunControlView,), {"action": action, "post": post}
    )
    return view.as_view()


class RunCopyView(ApiView):
    write_permission = CAN_CREATE

    @extend_schema(
        operation_id="runs_copy",
        request=schemas.RunCopy,
        responses={201: schemas.RunOut, 404: schemas.ErrorOut, 409: schemas.ErrorOut, **ERRORS},
    )
    def post(self, request: Request, run_id: int) -> Response:
        """A new run with this run's resolved settings and your overrides, owned by you."""
        source = get_or_404(Run, "run", pk=run_id)
        body = schemas.RunCopy(data=request.data)
        body.is_valid(raise_exception=True)
        d = body.validated_data
        run = create(
            name=d.get("name") or f"{source.name} (copy)"[:200],
            config=with_overrides(source.config, d["overrides"]),
            user=request.user,
            start=d["start"],
        )
        return Response(schemas.RunOut(run).data, status=status.HTTP_201_CREATED)


class RunSlotsView(ApiView):
    @extend_schema(
        operation_id="runs_slots",
        responses={200: schemas.SlotOut(many=True), 404: schemas.ErrorOut, **ERRORS},
    )
    def get(self, request: Request, run_id: int) -> Response:
        """The run's env slots: each slot's newest worker row, with its status and error."""
        run = get_or_404(Run, "run", pk=run_id)
        slots = current_slots(run=run).order_by("key")
        return Response(schemas.SlotOut(slots, many=True).data)
