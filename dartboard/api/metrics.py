"""A run's metrics (and a sweep's curves) as JSON and CSV: the run page's numbers, for a
notebook or a spreadsheet (`datamanager.selectors.metrics`)."""

from __future__ import annotations

import csv
import io

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from dartboard.api import schemas
from dartboard.api.base import ApiView, get_or_404, known_params
from dartboard.api.errors import ApiError
from datamanager.models import Run, Sweep
from datamanager.selectors.metrics import (
    KINDS,
    Table,
    greedy_points,
    metrics_table,
    run_metrics,
    sweep_greedy_table,
)

ERRORS = {**schemas.ERRORS, 404: schemas.ErrorOut}
CSV_RESPONSE = {
    (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="CSV with a header row.")
}


def csv_response(table: Table, filename: str) -> HttpResponse:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(table.header)
    writer.writerows(["" if v is None else v for v in row] for row in table.rows)
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


class RunMetricsView(ApiView):
    @extend_schema(operation_id="runs_metrics", responses={200: schemas.MetricsOut, **ERRORS})
    def get(self, request: Request, run_id: int) -> Response:
        """Greedy success per version with its 95% interval (training instances, held-out
        seeds, the eval split), the rollouts' success rate and throughput over time, and
        every update's metrics with the trainer-vs-rollout log-prob gap."""
        known_params(request, set())
        data = run_metrics(run=get_or_404(Run, "run", pk=run_id))
        upd = data.updates
        greedy = [
            {
                "scope": s,
                "version": p.version,
                "ok": p.ok,
                "scored": p.scored,
                "rate": p.rate,
                "low": p.low,
                "high": p.high,
            }
            for s, p in greedy_points(data.versions)
        ]
        return Response(
            {
                "run": run_id,
                "bucket": data.bucket,
                "greedy": greedy,
                "success": {"t": data.success.t, "values": data.success.values},
                "throughput": {
                    "t": data.throughput.t,
                    "actions_per_min": data.throughput.actions_per_min,
                    "trajectories_per_min": data.throughput.trajectories_per_min,
                },
                "updates": {"number": upd.number, "series": upd.series},
                "logprob_gap": {
                    "number": upd.number,
                    "mean": upd.series.get("logprob_gap_mean") or [None] * len(upd.number),
                    "p99": upd.series.get("logprob_gap_p99") or [None] * len(upd.number),
                    "alert": upd.gap_alert,
                },
            }
        )


class RunMetricsCsvView(ApiView):
    @extend_schema(
        operation_id="runs_metrics_csv",
        parameters=[OpenApiParameter("kind", str, enum=list(KINDS), default="greedy")],
        responses={**CSV_RESPONSE, **ERRORS},
    )
    def get(self, request: Request, run_id: int) -> HttpResponse:
        """One kind of the run's metrics as CSV: greedy (per version and scope), success,
        throughput or updates (one row per update, a column per metric)."""
        known_params(request, {"kind"})
        kind = request.query_params.get("kind", "greedy")
        if kind not in KINDS:
            raise ApiError(400, "invalid", f"kind must be one of {', '.join(KINDS)}", "kind")
        run = get_or_404(Run, "run", pk=run_id)
        return csv_response(metrics_table(run_metrics(run=run), kind), f"run-{run.pk}-{kind}.csv")


class SweepMetricsCsvView(ApiView):
    @extend_schema(operation_id="sweeps_metrics_csv", responses={**CSV_RESPONSE, **ERRORS})
    def get(self, request: Request, sweep_id: int) -> HttpResponse:
        """Greedy success per version of every member, with the member's grid values and
        seed: the sweep page's curves as rows."""
        known_params(request, set())
        sweep = get_or_404(Sweep, "sweep", pk=sweep_id)
        return csv_response(sweep_greedy_table(sweep_id=sweep.pk), f"sweep-{sweep.pk}.csv")
