"""Dataset exports from the browser: the trajectory list's filter written as a Hugging Face
dataset, an SFT view and/or OSWorld result folders by a background job
(`datamanager.services.datasets`), with its progress and a download link.

Viewers may export and download what they may read; nothing else in the media storage is
served from here.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.core.files.storage import default_storage
from django.http import (
    FileResponse,
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    QueryDict,
)
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from dartboard.forms import TrajectoryFilterForm
from dartboard.views import _user
from datamanager.models import DatasetExport, ExportStatus
from datamanager.roles import CAN_VIEW
from datamanager.services import datasets


@require_POST
@permission_required(CAN_VIEW, raise_exception=True)
def export_create(request: HttpRequest) -> HttpResponse:
    """POST the trajectory list's query (as `query`) and the formats: queue an export."""
    query = request.POST.get("query", "")
    form = TrajectoryFilterForm(QueryDict(query))
    if not form.is_valid():
        messages.error(request, f"Not exported: the filter is invalid ({form.errors.as_text()}).")
        return redirect(f"/trajectories/?{query}")
    try:
        export = datasets.dataset_export_create(
            flt=form.trajectory_filter(),
            query=query,
            formats=request.POST.getlist("formats"),
            user=_user(request),
        )
    except datasets.ExportError as exc:
        messages.error(request, f"Not exported: {exc}.")
        return redirect(f"/trajectories/?{query}")
    return redirect("export_detail", export_id=export.pk)


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def export_detail(request: HttpRequest, export_id: int) -> HttpResponse:
    export = get_object_or_404(DatasetExport, pk=export_id)
    return render(
        request,
        "dashboard/export_detail.html",
        {"export": export, "running": export.status in (ExportStatus.QUEUED, ExportStatus.RUNNING)},
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def export_download(request: HttpRequest, export_id: int) -> HttpResponseBase:
    export = get_object_or_404(DatasetExport, pk=export_id)
    if export.status != ExportStatus.DONE or not default_storage.exists(export.archive):
        raise Http404(f"export {export_id} has no archive ({export.status})")
    return FileResponse(
        default_storage.open(export.archive, "rb"),
        as_attachment=True,
        filename=f"dartboard-export-{export_id}.zip",
    )
