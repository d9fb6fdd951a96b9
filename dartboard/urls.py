from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_not_required
from django.urls import include, path, re_path

from dartboard import account_views, export_views, review_views, views
from dartboard.api.errors import not_found
from dartboard.forms import AdminLoginForm

admin.site.login_form = AdminLoginForm  # throttled like the dashboard's (login_throttle.py)

urlpatterns = [
    path("", views.runs_list, name="runs"),
    path("runs/new/", views.run_new, name="run_new"),
    path("runs/<int:run_id>/", views.run_detail, name="run_detail"),
    path("runs/<int:run_id>/control/", views.run_control, name="run_control"),
    path("runs/<int:run_id>/charts.json", views.run_charts, name="run_charts"),
    path("runs/<int:run_id>/slots.json", views.run_slots_json, name="run_slots"),
    path("runs/<int:run_id>/health.json", views.run_health, name="run_health"),
    path("runs/<int:run_id>/logs/<str:process>/", views.run_log, name="run_log"),
    path("runs/<int:run_id>/tasks/", views.task_board, name="task_board"),
    path(
        "runs/<int:run_id>/tasks/<int:stat_id>/override/",
        views.task_override,
        name="task_override",
    ),
    path("runs/<int:run_id>/labels/", review_views.label_queue, name="label_queue"),
    path("labels.jsonl", review_views.labels_export, name="labels_export"),
    path("groups/<int:group_id>/", review_views.group_detail, name="group_detail"),
    path("evaluations/compare/episodes/", review_views.episode_compare, name="episode_compare"),
    path("evaluations/", views.evaluation_list, name="evaluations"),
    path("evaluations/matrix/", views.evaluation_matrix, name="evaluation_matrix"),
    path("evaluations/compare/", views.evaluation_compare, name="evaluation_compare"),
    path("evaluations/<int:job_id>/", views.evaluation_detail, name="evaluation_detail"),
    path("trajectories/", views.trajectory_list, name="trajectories"),
    path("trajectories/upload/", views.upload, name="upload"),
    path("exports/", export_views.export_create, name="export_create"),
    path("exports/<int:export_id>/", export_views.export_detail, name="export_detail"),
    path("exports/<int:export_id>/download/", export_views.export_download, name="export_download"),
    path("trajectories/<int:trajectory_id>/", views.trajectory_detail, name="trajectory_detail"),
    path(
        "trajectories/<int:trajectory_id>/<str:action>/",
        views.trajectory_curate,
        name="trajectory_curate",
    ),
    path("sweeps/", account_views.sweep_list, name="sweeps"),
    path("sweeps/<int:sweep_id>/", account_views.sweep_detail, name="sweep_detail"),
    path("account/", account_views.account, name="account"),
    path("account/tokens/<int:token_id>/revoke/", account_views.token_revoke, name="token_revoke"),
    path("api/v1/", include("dartboard.api.urls")),
    re_path(r"^api/", login_not_required(not_found)),
    path("health/", views.health, name="health"),
    path("media/<path:key>", views.media, name="media"),
    path("vendor/plotly.min.js", views.plotly_js, name="plotly_js"),
    re_path(r"^flower(?P<rest>/.*)?$", views.flower, name="flower"),
    path("accounts/login/", views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
]
