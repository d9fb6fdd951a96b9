"""Dataset exports: start one from the trajectory list's filters, read its progress, download
its .zip with the same token (datamanager.services.datasets; written by the default queue's
worker, as the browser's are)."""

from __future__ import annotations

from django.core.files.storage import default_storage
from django.http import FileResponse, QueryDict
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from dartboard.api import schemas
from dartboard.api.base import ApiView, get_or_404
from dartboard.api.errors import ApiError, body, problem
from dartboard.forms import TrajectoryFilterForm
from datamanager.models import DatasetExport, ExportStatus
from datamanager.roles import CAN_VIEW
from datamanager.services.datasets import EXPORT_FORMATS, dataset_export_create


class ExportIn(schemas.Body):
    query = schemas.Text(
        required=False,
        allow_blank=True,
        help_text="The trajectory list's filters as its query string, e.g. run=3&status=succeeded.",
    )
    formats = serializers.ListField(
        child=serializers.ChoiceField(choices=EXPORT_FORMATS), min_length=1, default=["hf"]
    )


class ExportOut(serializers.Serializer):
    id = serializers.IntegerField(source="pk")
    status = serializers.ChoiceField(choices=ExportStatus.choices)
    formats = serializers.ListField(child=serializers.CharField())
    query = serializers.SerializerMethodField()
    done = serializers.IntegerField(help_text="Trajectories written.")
    total = serializers.IntegerField(help_text="Trajectories the filter matched.")
    error = serializers.CharField()
    created_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    download = serializers.SerializerMethodField(help_text="The .zip, once done (same token).")

    def get_query(self, export: DatasetExport) -> str:
        return str(export.filter.get("query", ""))

    def get_download(self, export: DatasetExport) -> str | None:
        done = export.status == ExportStatus.DONE
        return f"/api/v1/exports/{export.pk}/download/" if done else None


class ExportsView(ApiView):
    write_permission = CAN_VIEW  # what a viewer may read, a viewer may export

    @extend_schema(
        operation_id="exports_create",
        request=ExportIn,
        responses={202: ExportOut, **schemas.ERRORS},
    )
    def post(self, request: Request) -> Response:
        """Export the trajectories the filters select (hf, sft, osworld) in the background."""
        parsed = ExportIn(data=request.data)
        parsed.is_valid(raise_exception=True)
        query = parsed.validated_data.get("query", "").strip().lstrip("?")
        form = TrajectoryFilterForm(QueryDict(query))
        if not form.is_valid():
            problems = [
                problem("invalid", f"query: {name}: {' '.join(map(str, errs))}", "query")
                for name, errs in form.errors.items()
            ]
            return Response(body(problems), status=400)
        export = dataset_export_create(
            flt=form.trajectory_filter(),
            query=query,
            formats=parsed.validated_data["formats"],
            user=request.user,
        )
        return Response(ExportOut(export).data, status=202)


class ExportView(ApiView):
    @extend_schema(
        operation_id="exports_read",
        responses={200: ExportOut, 404: schemas.ErrorOut, **schemas.ERRORS},
    )
    def get(self, request: Request, export_id: int) -> Response:
        """An export's status and progress, and its download URL once done."""
        return Response(ExportOut(get_or_404(DatasetExport, "export", pk=export_id)).data)


class ExportDownloadView(ApiView):
    @extend_schema(
        operation_id="exports_download",
        responses={
            (200, "application/zip"): OpenApiResponse(OpenApiTypes.BINARY),
            404: schemas.ErrorOut,
            409: schemas.ErrorOut,
            **schemas.ERRORS,
        },
    )
    def get(self, request: Request, export_id: int) -> FileResponse:
        """The export's .zip (a Hugging Face dataset folder, OSWorld folders)."""
        export = get_or_404(DatasetExport, "export", pk=export_id)
        if export.status != ExportStatus.DONE or not default_storage.exists(export.archive):
            reason = export.error or f"it is {export.status}"
            raise ApiError(409, "conflict", f"export {export_id} has no archive: {reason}")
        return FileResponse(
            default_storage.open(export.archive, "rb"),
            as_attachment=True,
            filename=f"dartboard-export-{export_id}.zip",
        )
