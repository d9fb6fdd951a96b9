"""A run's process logs: which processes it has on which host, and the end of each one's
log as text, copied from its host by the host agent (`hostagent.log_ship`, secrets
redacted), so a process on another machine is read without a shell there."""

from __future__ import annotations

from django.http import HttpResponse
from django.utils.http import http_date
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from dartboard.api import schemas
from dartboard.api.base import ApiView, get_or_404, known_params, query_of
from dartboard.api.errors import ApiError
from datamanager.models import Run
from datamanager.selectors.process_logs import (
    ProcessLogNotFound,
    ProcessOnSeveralHosts,
    process_log_find,
    process_logs_list,
)
from datamanager.services.process_logs import TAIL_BYTES

ERRORS = {**schemas.ERRORS, 404: schemas.ErrorOut}


class RunLogsView(ApiView):
    @extend_schema(
        operation_id="runs_logs", responses={200: schemas.ProcessLogOut(many=True), **ERRORS}
    )
    def get(self, request: Request, run_id: int) -> Response:
        """The run's processes with a log, by host: each log's size, whether the process ran
        when it was last copied, when that was, and the URL of its tail."""
        known_params(request, set())
        run = get_or_404(Run, "run", pk=run_id)
        return Response(schemas.ProcessLogOut(process_logs_list(run_id=run.pk), many=True).data)


class RunLogView(ApiView):
    @extend_schema(
        operation_id="runs_log",
        parameters=[schemas.ProcessLogQuery],
        responses={
            (200, "text/plain"): OpenApiResponse(
                OpenApiTypes.STR,
                description=f"The log's last lines (at most {TAIL_BYTES // 1024} KiB).",
            ),
            **ERRORS,
        },
    )
    def get(self, request: Request, run_id: int, process: str) -> HttpResponse:
        """The end of one process's log as text (`inference-0`, `router`, `worker-train`,
        `worker-env-0`), its secrets masked; `host` names the host where the run has a
        process of that name on several."""
        query = query_of(request, schemas.ProcessLogQuery)
        run = get_or_404(Run, "run", pk=run_id)
        try:
            row = process_log_find(run_id=run.pk, process=process, host=query.get("host"))
        except ProcessOnSeveralHosts as exc:
            raise ApiError(400, "invalid", str(exc), "host") from None
        except ProcessLogNotFound as exc:
            raise ApiError(404, "not_found", str(exc)) from None
        response = HttpResponse(row.tail, content_type="text/plain; charset=utf-8")
        response["Last-Modified"] = http_date(row.updated_at.timestamp())
        return response
