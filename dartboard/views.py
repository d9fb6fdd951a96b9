"""Dashboard views: thin interfaces over datamanager selectors/services.

Every view needs a login (LoginRequiredMiddleware); changes are POST with CSRF.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, cast

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_not_required, permission_required
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.http import (
    FileResponse,
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    JsonResponse,
)
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.cache import cache_control
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from dartboard import figures, svg, viewmodels
from dartboard import flower as flower_proxy
from dartboard import health as service_health
from dartboard.consumers import MAX_SLOTS
from dartboard.forms import (
    EvalCompareForm,
    EvalJobFilterForm,
    LoginForm,
    RewardOverrideForm,
    RunForm,
    TaskOverrideForm,
    TrajectoryFilterForm,
    TrimForm,
    UploadForm,
)
from dartboard.screenshots import screenshot_open
from datamanager.archive import InvalidUpload, archive_open
from datamanager.models import EvalJob, Run, RunStatus, Trajectory
from datamanager.roles import CAN_ADMINISTER, CAN_CONTROL, CAN_CREATE, CAN_CURATE, CAN_VIEW
from datamanager.selectors import charts, env_health, evaluations, groups, trajectories
from datamanager.selectors import runs as run_reads
from datamanager.selectors.aggregates import bucket_width, outcome_rows
from datamanager.selectors.outages import recent_outages
from datamanager.selectors.process_logs import (
    ProcessLogNotFound,
    ProcessOnSeveralHosts,
    process_log_find,
    process_logs_list,
)
from datamanager.selectors.runs import run_find, run_status, run_task_names, task_stat_find
from datamanager.selectors.trajectories import failure_label
from datamanager.services import demos, review, run_workers
from datamanager.services import runs as services


def _user(request: HttpRequest) -> User:
    """The signed-in user: LoginRequiredMiddleware turns anonymous requests away first."""
    assert isinstance(request.user, User)
    return request.user


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def runs_list(request: HttpRequest) -> HttpResponse:
    runs = list(run_reads.runs_overview()[:200])
    for run in runs:
        row = cast(Any, run)  # n_succeeded/n_finished come from runs_overview's .annotate()
        row.success_rate = run_reads.success_rate(row.n_succeeded, row.n_finished)
    return render(request, "dashboard/runs.html", {"runs": runs, "hosts": viewmodels.host_rows()})


@require_http_methods(["GET", "POST"])
@permission_required(CAN_CREATE, raise_exception=True)
def run_new(request: HttpRequest) -> HttpResponse:
    """The run form. GET ?from=<run id> pre-fills it from that run's resolved config."""
    if request.method == "POST":
        form = RunForm(request.POST, user=_user(request))
        if form.is_valid():
            run = services.run_create(
                name=form.cleaned_data["name"], config=form.config, owner=_user(request)
            )
            messages.success(request, f"Run {run.name} created.")
            return redirect("run_detail", run_id=run.pk)
        return render(request, "dashboard/run_form.html", {"form": form}, status=400)
    source = None
    if request.GET.get("from", "").isdigit():
        source = run_find(run_id=int(request.GET["from"]))
    form = RunForm(
        initial={"name": f"{source.name} (copy)"} if source else {},
        from_config=source.config if source else None,
    )
    return render(request, "dashboard/run_form.html", {"form": form, "source": source})


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def run_detail(request: HttpRequest, run_id: int) -> HttpResponse:
    run = get_object_or_404(Run, pk=run_id)
    services = service_health.BOARD.services(run_id=run.pk, trainer=run.status == RunStatus.RUNNING)
    wall = _wall(request, run)
    task_names = run_task_names(run=run)
    return render(
        request,
        "dashboard/run_detail.html",
        {
            "run": run,
            "summary": run_reads.run_summary(run=run),
            "wall": wall,
            "wall_statuses": viewmodels.WALL_STATUSES,
            "live_work": viewmodels.live_work_rows(run=run),
            "task_names": task_names,
            "config_json": json.dumps(run.config, indent=2),
            "health": services,
            "outage_banner": service_health.outage_banner(services),
            "outages": recent_outages(),
            "alerts": viewmodels.run_alerts(run=run) + env_health.health_alerts(run=run),
            "hosts": env_health.host_map(run=run),
            "dead_time": viewmodels.dead_time_notes(run=run),
            "unsolved": viewmodels.unsolved_tasks_note(run=run),
            "placement": viewmodels.placement_note(run=run),
            "checkpoints": viewmodels.checkpoint_note(run=run),
            "flow": viewmodels.flow_note(run=run),
            "flow_windows": viewmodels.flow_windows(run=run),
            "held": viewmodels.held_note(run=run),
            "process_logs": process_logs_list(run_id=run.pk),
        },
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def run_log(request: HttpRequest, run_id: int, process: str) -> HttpResponse:
    """The end of one of the run's process logs as text, as its host agent copied it (the
    run page links each, with its host; the API's `runs_log` serves the same)."""
    run = get_object_or_404(Run, pk=run_id)
    try:
        row = process_log_find(run_id=run.pk, process=process, host=request.GET.get("host"))
    except ProcessOnSeveralHosts as exc:
        return HttpResponse(str(exc), status=400, content_type="text/plain; charset=utf-8")
    except ProcessLogNotFound as exc:
        raise Http404(str(exc)) from None
    return HttpResponse(row.tail, content_type="text/plain; charset=utf-8")


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def run_health(request: HttpRequest, run_id: int) -> JsonResponse:
    """The run page's health line: each service up or down since when, with its last error
    (dartboard/health.py); polled by static/dartboard/health.js."""
    status = run_status(run_id=run_id)
    if status is None:
        raise Http404(f"no run {run_id}")
    services = service_health.BOARD.services(run_id=run_id, trainer=status == RunStatus.RUNNING)
    return JsonResponse(
        {
            "services": [s.as_json() for s in services],
            "banner": service_health.outage_banner(services),
        }
    )


@require_POST
@permission_required(CAN_CONTROL, raise_exception=True)
def run_control(request: HttpRequest, run_id: int) -> HttpResponse:
    get_object_or_404(Run, pk=run_id)
    action = request.POST.get("action", "")
    try:
        run = run_workers.run_apply(run_id=run_id, action=action, user=_user(request))
    except (services.InvalidTransition, run_workers.RunNotStartable, services.NotYourRun) as exc:
        messages.error(request, f"Could not {action or 'change'} the run: {exc}.")
    else:
        messages.success(request, f"Run {run.name} is {run.status}.")
    return redirect("run_detail", run_id=run_id)


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def run_charts(request: HttpRequest, run_id: int) -> JsonResponse:
    """Every run-page chart as Plotly figure JSON (refreshed by static/dartboard/charts.js)."""
    run = get_object_or_404(Run, pk=run_id)
    rows = outcome_rows(run=run, width=bucket_width(run))  # one pass
    return JsonResponse(
        figures.run_figures(
            charts.chart_data(run=run, rows=rows),
            env_health.health_chart_data(run=run, rows=rows),
        )
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def run_slots_json(request: HttpRequest, run_id: int) -> JsonResponse:
    """A page of the env wall as JSON (the wall's fallback when the WebSocket is down), with
    the same filters as the run page: ?status=&q=&page=."""
    run = get_object_or_404(Run, pk=run_id)
    tasks = run_task_names(run=run)
    wall = _wall(request, run)
    return JsonResponse(
        {
            "slots": [t.__dict__ for t in wall.tiles],
            "tasks": tasks,
            "counts": wall.counts,
            "total": wall.total,
            "page": wall.page,
            "pages": wall.pages,
        }
    )


def _wall(request: HttpRequest, run: Run) -> viewmodels.SlotWall:
    """The env wall page the request asks for (?status=&q=&page=&per=); an unknown status is
    ignored rather than an error, like a stale link's page number, and `per` (tiles a page,
    WALL_PER_PAGE unless given) is kept within what one live socket follows."""
    status = request.GET.get("status", "")
    per = request.GET.get("per", "")
    return viewmodels.run_slots(
        run=run,
        status=status if status in viewmodels.WALL_STATUSES else "",
        query=request.GET.get("q", "").strip()[:200],
        page=request.GET.get("page", 1),
        per_page=min(max(int(per), 1), MAX_SLOTS) if per.isdigit() else viewmodels.WALL_PER_PAGE,
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def task_board(request: HttpRequest, run_id: int) -> HttpResponse:
    run = get_object_or_404(Run, pk=run_id)
    rows = run_reads.task_board(run=run)
    for row in rows:
        cast(Any, row).spark = svg.sparkline_svg(row.history)  # for the template only
    return render(request, "dashboard/task_board.html", {"run": run, "rows": rows})


@require_http_methods(["GET", "POST"])
@permission_required(CAN_CURATE, raise_exception=True)
def task_override(request: HttpRequest, run_id: int, stat_id: int) -> HttpResponse:
    stat = task_stat_find(run_id=run_id, stat_id=stat_id)
    if stat is None:
        raise Http404(f"run {run_id} has no task statistics {stat_id}")
    if request.method == "POST":
        form = TaskOverrideForm(request.POST)
        if form.is_valid():
            try:
                review.taskstat_override(
                    stat_id=stat.pk,
                    pinned_budget=form.cleaned_data["pinned_budget"],
                    boost=form.cleaned_data["boost"],
                    retired=form.cleaned_data["retired"],
                    reason=form.cleaned_data["reason"],
                    user=_user(request),
                )
            except review.CurationError as exc:
                form.add_error(None, str(exc))
            else:
                messages.success(request, f"Task {stat.task.name} updated.")
                return redirect("task_board", run_id=run_id)
        status = 400
    else:
        form = TaskOverrideForm(
            initial={
                "pinned_budget": stat.pinned_budget,
                "boost": stat.boost,
                "retired": stat.retired,
            }
        )
        status = 200
    return render(
        request, "dashboard/task_override.html", {"stat": stat, "form": form}, status=status
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def trajectory_list(request: HttpRequest) -> HttpResponse:
    form = TrajectoryFilterForm(request.GET or None)
    flt = trajectories.TrajectoryFilter()
    if form.is_bound and form.is_valid():
        flt = form.trajectory_filter()
    page = trajectories.trajectory_page(flt=flt, page=request.GET.get("page", 1))
    query = _query_without_page(request)
    unranged = request.GET.copy()
    for key in ("page", "reward_min", "reward_max"):
        unranged.pop(key, None)
    histogram = svg.reward_histogram_svg(
        trajectories.reward_histogram(flt=flt),
        query=unranged.urlencode(),
        selected=(flt.reward_min, flt.reward_max),
    )
    return render(
        request,
        "dashboard/trajectory_list.html",
        {
            "form": form,
            "page": page,
            "query": query,
            "histogram": histogram,
            # The filters past the first ten fold away unless one is set.
            "more_open": any(request.GET.get(name) for name in list(form.fields)[10:]),
        },
        status=200 if not form.errors else 400,
    )


def _query_without_page(request: HttpRequest) -> str:
    """The listing's query string for its page links (they add their own page=)."""
    query = request.GET.copy()
    query.pop("page", None)
    return query.urlencode()


def _run_filter(request: HttpRequest) -> tuple[EvalJobFilterForm, int | None, Run | None]:
    """The optional ?run=ID of the evaluation pages: (form, run id, the run if it exists)."""
    form = EvalJobFilterForm(request.GET)
    run_id = form.cleaned_data["run"] if form.is_valid() else None
    return form, run_id, run_find(run_id=run_id) if run_id else None


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def evaluation_list(request: HttpRequest) -> HttpResponse:
    form, run_id, run = _run_filter(request)
    listing = evaluations.eval_job_list(run_id=run_id, page=request.GET.get("page", 1))
    query = _query_without_page(request)
    return render(
        request,
        "dashboard/evaluations.html",
        {
            "form": form,
            "run_id": run_id,
            "run": run,
            "listing": listing,
            "query": query,
        },
        status=400 if form.errors else 200,
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def evaluation_detail(request: HttpRequest, job_id: int) -> HttpResponse:
    try:
        report = evaluations.eval_job_report(job_id=job_id)
    except EvalJob.DoesNotExist:
        raise Http404(f"no evaluation job {job_id}") from None
    return render(request, "dashboard/evaluation_detail.html", {"report": report})


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def evaluation_matrix(request: HttpRequest) -> HttpResponse:
    form, run_id, run = _run_filter(request)
    matrix = evaluations.eval_matrix(run_id=run_id)
    figure = figures.eval_heatmap(
        columns=[f"{job.name} #{job.pk}" for job in matrix.jobs],
        tasks=[row.task for row in matrix.rows],
        rates=[[c.success_rate if c else None for c in row.cells] for row in matrix.rows],
    )
    return render(
        request,
        "dashboard/evaluation_matrix.html",
        {"form": form, "run_id": run_id, "run": run, "matrix": matrix, "figure": figure},
        status=400 if form.errors else 200,
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def evaluation_compare(request: HttpRequest) -> HttpResponse:
    """?a=ID&b=ID. A missing, malformed or unknown id is explained on the page."""
    form = EvalCompareForm(request.GET or None)
    context: dict[str, Any] = {"form": form}
    if not form.is_bound:
        context["problem"] = "Choose two evaluation jobs to compare (their ids as a and b)."
        return render(request, "dashboard/evaluation_compare.html", context)
    if not form.is_valid():
        errors = form.errors.items()
        bad = "; ".join(f"{name}: {' '.join(map(str, errs))}" for name, errs in errors)
        context["problem"] = f"Give two evaluation job ids, ?a=ID&b=ID ({bad})"
        return render(request, "dashboard/evaluation_compare.html", context, status=400)
    a_id, b_id = form.cleaned_data["a"], form.cleaned_data["b"]
    try:
        a, b, rows = evaluations.eval_compare(a_id=a_id, b_id=b_id)
    except evaluations.EvalJobMissing as exc:
        context["problem"] = f"Nothing to compare: there is {exc}."
        return render(request, "dashboard/evaluation_compare.html", context, status=404)
    seeds = groups.shared_seeds(a_id=a_id, b_id=b_id)  # what opens episode by episode
    context.update(
        a=a,
        b=b,
        rows=[(row, seeds.get(row.task, [])[:12]) for row in rows],
        n_differ=sum(r.differs for r in rows),
    )
    return render(request, "dashboard/evaluation_compare.html", context)


def _trajectory_context(trajectory_id: int, **forms) -> dict:
    try:
        traj, steps = trajectories.trajectory_detail(trajectory_id=trajectory_id)
    except Trajectory.DoesNotExist:
        raise Http404(f"no trajectory {trajectory_id}") from None
    for s in steps:
        shown = cast(Any, s)  # attributes for the template only
        shown.overlay = svg.action_overlay_svg(
            s.action, width=s.screen_width, height=s.screen_height, uid=str(s.pk)
        )
        lp = s.rollout_logprobs or []
        shown.logprob_sum = sum(lp) if lp else None
        shown.logprob_mean = sum(lp) / len(lp) if lp else None
    return {
        "traj": traj,
        "steps": steps,
        "overrides": traj.reward_overrides.select_related("user").order_by("-created_at"),
        "label": failure_label(trajectory=traj),
        "copies": traj.curated_copies.only("pk", "length", "source"),
        "reward_form": RewardOverrideForm(initial={"reward": traj.reward}),
        "trim_form": TrimForm(initial={"keep_steps": max(1, traj.length - 1)}),
        **forms,
    }


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def trajectory_detail(request: HttpRequest, trajectory_id: int) -> HttpResponse:
    return render(request, "dashboard/trajectory_detail.html", _trajectory_context(trajectory_id))


@require_POST
@permission_required(CAN_CURATE, raise_exception=True)
def trajectory_curate(request: HttpRequest, trajectory_id: int, action: str) -> HttpResponse:
    """promote / unpool / reject / trim / reward, each one service call."""
    traj = get_object_or_404(Trajectory, pk=trajectory_id)
    target = reverse("trajectory_detail", args=[traj.pk])
    try:
        if action == "promote":
            review.trajectory_promote(trajectory_id=traj.pk, user=_user(request))
            messages.success(request, "Added to the task's experience pool.")
        elif action == "unpool":
            review.trajectory_unpool(trajectory_id=traj.pk)
            messages.success(request, "Removed from the experience pool.")
        elif action == "reject":
            review.trajectory_reject(trajectory_id=traj.pk, user=_user(request))
            messages.success(request, "Rejected: it will never be trained on.")
        elif action == "trim":
            form = TrimForm(request.POST)
            if not form.is_valid():
                return _invalid(request, traj, "trim_form", form)
            copy = review.trajectory_trim(
                trajectory_id=traj.pk, keep_steps=form.cleaned_data["keep_steps"]
            )
            messages.success(request, f"Curated copy #{copy.pk} with {copy.length} steps.")
            target = reverse("trajectory_detail", args=[copy.pk])
        elif action == "reward":
            if not request.user.has_perm(CAN_ADMINISTER):
                raise PermissionDenied("only an admin may override a reward")
            reward_form = RewardOverrideForm(request.POST)
            if not reward_form.is_valid():
                return _invalid(request, traj, "reward_form", reward_form)
            review.trajectory_override_reward(
                trajectory_id=traj.pk,
                reward=reward_form.cleaned_data["reward"],
                reason=reward_form.cleaned_data["reason"],
                user=_user(request),
            )
            messages.success(request, "Reward overridden.")
        else:
            raise Http404(f"no curation action {action!r}")
    except review.CurationError as exc:
        messages.error(request, f"Not done: {exc}.")
    return HttpResponseRedirect(target)


def _invalid(request: HttpRequest, traj: Trajectory, name: str, form) -> HttpResponse:
    """Re-render the trajectory page with the invalid form's errors at its fields."""
    ctx = _trajectory_context(traj.pk, **{name: form})
    return render(request, "dashboard/trajectory_detail.html", ctx, status=400)


@require_http_methods(["GET", "POST"])
@permission_required(CAN_CURATE, raise_exception=True)
def upload(request: HttpRequest) -> HttpResponse:
    """Import demonstrations from a .zip: Dartboard's archive, OSWorld result folders or
    AgentNet lines (datamanager/services/demos.py)."""
    errors: list[str] = []
    if request.method == "POST":
        form = UploadForm(request.POST, request.FILES)
        if form.is_valid():
            d = form.cleaned_data
            try:
                report = demos.demos_import(
                    files=archive_open(d["archive"]),
                    fmt=d["format"],
                    accept=d["accept"],
                    user=_user(request),
                    task=d["task"],
                    screen=d["screen"],
                )
            except InvalidUpload as exc:
                errors = exc.errors
                form.add_error("archive", f"{len(exc.errors)} problem(s); nothing was imported.")
            else:
                messages.success(request, demos.import_summary(report))
                for note in report.notes[:20] + report.skipped[:20] + report.duplicates[:20]:
                    messages.info(request, note)
                query = "?source=precollected" + ("" if d["accept"] else "&reviewed=no")
                return redirect(reverse("trajectories") + query)
        return render(
            request, "dashboard/upload.html", {"form": form, "errors": errors}, status=400
        )
    return render(request, "dashboard/upload.html", {"form": UploadForm(), "errors": errors})


@login_not_required
@require_GET
def health(request: HttpRequest) -> JsonResponse:
    """Liveness for load balancers; says nothing about the data."""
    return JsonResponse({"status": "ok"})


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def media(request: HttpRequest, key: str) -> HttpResponseBase:
    """A step's screenshot, to users who may view runs (dartboard/screenshots.py)."""
    opened = screenshot_open(key)
    if opened is None:
        raise Http404(f"no screenshot {key!r}")
    return FileResponse(opened, content_type="image/png")


class LoginView(auth_views.LoginView):
    """Django's login with the throttled form: a refusal for too many failures is a 429
    with Retry-After (dartboard/login_throttle.py)."""

    form_class = LoginForm

    def form_invalid(self, form: LoginForm) -> HttpResponse:  # type: ignore[override]
        response = super().form_invalid(form)
        if form.retry_after is not None:
            response.status_code = 429
            response["Retry-After"] = str(form.retry_after)
        return response


@csrf_exempt  # Flower's own pages post without Django's token: same_origin() stands in
@permission_required(CAN_ADMINISTER, raise_exception=True)
def flower(request: HttpRequest, rest: str | None = None) -> HttpResponse:
    """Flower (the Celery monitor; its API runs any task) behind the dashboard's login, for
    admins only: the request goes on to the Flower process with Flower's own login, which
    no user needs to know (dartboard/flower.py)."""
    if request.method not in ("GET", "HEAD", "OPTIONS") and not flower_proxy.same_origin(request):
        raise PermissionDenied("a cross-site request to Flower is refused")
    reply = flower_proxy.forward(request)
    response = HttpResponse(reply.body, status=reply.status)
    for name, value in reply.headers:
        response[name] = value
    return response


@require_GET
@cache_control(max_age=86400)
def plotly_js(request: HttpRequest) -> HttpResponseBase:
    """plotly.js from the installed plotly package (the dashboard works offline)."""
    path = resources.files("plotly") / "package_data" / "plotly.min.js"
    return FileResponse(path.open("rb"), content_type="application/javascript")
