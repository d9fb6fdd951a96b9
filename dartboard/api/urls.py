"""`/api/v1/`: every endpoint, the OpenAPI schema, and a JSON 404 for any other /api/ path."""

from __future__ import annotations

from django.contrib.auth.decorators import login_not_required
from django.urls import path, re_path
from drf_spectacular.views import SpectacularAPIView

from dartboard.api import catalog, exports, logs, metrics, runs, sweeps, trajectories
from dartboard.api.errors import not_found
from dartboard.api.trajectories import curate_view

CURATION = {
    "accept": "Accept it: a successful trajectory joins its task's experience pool.",
    "unpool": "Take it out of the experience pool.",
    "reject": "Reject it: it is never trained on.",
    "trim": "A curated copy with its first keep_steps steps (201: the copy).",
    "label": "Label why it went wrong (env_bug also rejects it); labelling again replaces it.",
    "reward": "Override its reward, with the reason (admins only); audited.",
}

urlpatterns = [
    path(
        "schema/",
        login_not_required(
            SpectacularAPIView.as_view(permission_classes=[], authentication_classes=[])
        ),
        name="api_schema",
    ),
    path("me/", catalog.MeView.as_view(), name="api_me"),
    path("runs/", runs.RunsView.as_view(), name="api_runs"),
    path("runs/<int:run_id>/", runs.RunView.as_view(), name="api_run"),
    *[
        path(
            f"runs/<int:run_id>/{action}/",
            runs.control_view(action),
            name=f"api_run_{action}",
        )
        for action in ("start", "pause", "resume", "stop")
    ],
    path("runs/<int:run_id>/copy/", runs.RunCopyView.as_view(), name="api_run_copy"),
    path("runs/<int:run_id>/slots/", runs.RunSlotsView.as_view(), name="api_run_slots"),
    path("runs/<int:run_id>/logs/", logs.RunLogsView.as_view(), name="api_run_logs"),
    path("runs/<int:run_id>/logs/<str:process>/", logs.RunLogView.as_view(), name="api_run_log"),
    path("runs/<int:run_id>/metrics/", metrics.RunMetricsView.as_view(), name="api_run_metrics"),
    path(
        "runs/<int:run_id>/metrics.csv",
        metrics.RunMetricsCsvView.as_view(),
        name="api_run_metrics_csv",
    ),
    path("sweeps/", sweeps.SweepsView.as_view(), name="api_sweeps"),
    path("sweeps/<int:sweep_id>/", sweeps.SweepView.as_view(), name="api_sweep"),
    path("sweeps/<int:sweep_id>/stop/", sweeps.SweepStopView.as_view(), name="api_sweep_stop"),
    path(
        "sweeps/<int:sweep_id>/metrics.csv",
        metrics.SweepMetricsCsvView.as_view(),
        name="api_sweep_metrics_csv",
    ),
    path("trajectories/", trajectories.TrajectoriesView.as_view(), name="api_trajectories"),
    path(
        "trajectories/<int:trajectory_id>/",
        trajectories.TrajectoryView.as_view(),
        name="api_trajectory",
    ),
    *[
        path(
            f"trajectories/<int:trajectory_id>/{action}/",
            curate_view(action, summary),
            name=f"api_trajectory_{action}",
        )
        for action, summary in CURATION.items()
    ],
    path("exports/", exports.ExportsView.as_view(), name="api_exports"),
    path("exports/<int:export_id>/", exports.ExportView.as_view(), name="api_export"),
    path(
        "exports/<int:export_id>/download/",
        exports.ExportDownloadView.as_view(),
        name="api_export_download",
    ),
    path("screenshots/<path:key>", trajectories.ScreenshotView.as_view(), name="api_screenshot"),
    path("tasks/", catalog.TasksView.as_view(), name="api_tasks"),
    path("tasks/<int:task_id>/", catalog.TaskView.as_view(), name="api_task"),
    path("evaluations/", catalog.EvaluationsView.as_view(), name="api_evaluations"),
    path("evaluations/<int:job_id>/", catalog.EvaluationView.as_view(), name="api_evaluation"),
    path("hosts/", catalog.HostsView.as_view(), name="api_hosts"),
    re_path(r"^(?P<rest>.*)$", login_not_required(not_found)),
]
