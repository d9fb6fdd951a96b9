"""Dashboard views for reviewing rollouts: a GRPO group side by side, two checkpoints'
episodes side by side, and the failure-annotation queue with its JSONL export.

Thin interfaces over `datamanager.selectors.groups`, `datamanager.selectors.labels` and
`datamanager.services.labels`. Viewers read; labelling is a curator's (operator, admin); a
reward override stays an admin's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any, cast

from django.contrib import messages
from django.contrib.auth.decorators import permission_required
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods

from dartboard import svg
from dartboard.views import _user
from datamanager.models import EvalJob, FailureKind, Run, Step, TaskGroup
from datamanager.roles import CAN_CURATE, CAN_VIEW
from datamanager.selectors import groups, labels
from datamanager.selectors.trajectories import trajectory_steps
from datamanager.services import labels as label_services
from datamanager.services.review import CurationError

# The annotation queue's keys: one press labels the rollout shown and serves the next.
SHORTCUTS = [
    ("e", FailureKind.ENV_BUG),
    ("a", FailureKind.AGENT_MISTAKE),
    ("r", FailureKind.REWARD_WRONG),
    ("f", FailureKind.FINE),
]


def _with_overlays(steps: Iterable[Step], lane: str) -> list[Step]:
    """Steps with their action overlay for the filmstrip (ids unique per lane)."""
    shown = []
    for s in steps:
        step = cast(Any, s)  # an attribute for the template only
        step.overlay = svg.action_overlay_svg(
            s.action, width=s.screen_width, height=s.screen_height, uid=f"{lane}-{s.pk}"
        )
        shown.append(step)
    return shown


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def group_detail(request: HttpRequest, group_id: int) -> HttpResponse:
    try:
        view = groups.group_view(group_id=group_id)
    except TaskGroup.DoesNotExist:
        raise Http404(f"no group {group_id}") from None
    for member in view.members:
        _with_overlays(member.steps, f"m{member.trajectory.pk}")
    return render(
        request,
        "dashboard/group_detail.html",
        {"view": view, "group": view.group, "columns": range(view.width)},
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def episode_compare(request: HttpRequest) -> HttpResponse:
    """?a=JOB&b=JOB&task=NAME&seed=N: the two jobs' episodes side by side."""
    try:
        a_id, b_id = int(request.GET["a"]), int(request.GET["b"])
        task, seed = request.GET["task"], int(request.GET["seed"])
    except (KeyError, ValueError):
        return render(
            request,
            "dashboard/episode_compare.html",
            {
                "problem": "Give two evaluation jobs, a task and a seed: ?a=ID&b=ID&task=NAME&seed=N."
            },
            status=400,
        )
    try:
        pair = groups.episode_pair(a_id=a_id, b_id=b_id, task=task, seed=seed)
    except EvalJob.DoesNotExist:
        raise Http404(f"no evaluation job {a_id} or {b_id}") from None
    _with_overlays(pair.a_steps, "a")
    _with_overlays(pair.b_steps, "b")
    problem = ""
    if pair.a is None or pair.b is None:
        missing = [name for name, t in (("A", pair.a), ("B", pair.b)) if t is None]
        problem = f"Job {' and '.join(missing)} has no episode of {task} with seed {seed}."
    return render(
        request,
        "dashboard/episode_compare.html",
        {"pair": pair, "columns": range(pair.width), "problem": problem},
        status=404 if problem else 200,
    )


def _skips(request: HttpRequest) -> tuple[int, ...]:
    return tuple(int(x) for x in request.GET.get("skip", "").split(",") if x.isdigit())[-200:]


@require_http_methods(["GET", "POST"])
@permission_required(CAN_CURATE, raise_exception=True)
def label_queue(request: HttpRequest, run_id: int) -> HttpResponse:
    """GET: the next rollout to label (?queue=failed|sampled, ?skip=ids passed over). POST:
    label one (trajectory, label, comment) and come back for the next; a `reward_wrong`
    label goes on to the trajectory's audited reward override."""
    run = get_object_or_404(Run, pk=run_id)
    scope = request.GET.get("queue", "failed")
    if scope not in labels.QUEUE_SCOPES:
        scope = "failed"
    if request.method == "POST":
        trajectory_id = request.POST.get("trajectory", "")
        if not trajectory_id.isdigit():
            messages.error(request, "Not labelled: the form named no trajectory.")
        else:
            try:
                label_services.trajectory_label(
                    trajectory_id=int(trajectory_id),
                    label=request.POST.get("label", ""),
                    comment=request.POST.get("comment", ""),
                    user=_user(request),
                )
            except CurationError as exc:
                messages.error(request, f"Not labelled: {exc}.")
            else:
                label = FailureKind(request.POST["label"])
                messages.success(request, f"Trajectory {trajectory_id}: {label.label}.")
                if label == FailureKind.REWARD_WRONG:
                    return redirect(
                        reverse("trajectory_detail", args=[int(trajectory_id)]) + "#reward-form"
                    )
        query = request.GET.urlencode()
        return redirect(reverse("label_queue", args=[run.pk]) + (f"?{query}" if query else ""))
    skip = _skips(request)
    head = labels.label_queue_head(run_id=run.pk, scope=scope, skip=skip)
    steps: list[Step] = []
    if head.trajectory is not None:
        steps = _with_overlays(trajectory_steps(trajectory=head.trajectory), "q")
    skip_next = ",".join(map(str, (*skip, head.trajectory.pk))) if head.trajectory else ""
    return render(
        request,
        "dashboard/label_queue.html",
        {
            "run": run,
            "scope": scope,
            "head": head,
            "traj": head.trajectory,
            "steps": steps,
            "shortcuts": [(key, kind.value, kind.label) for key, kind in SHORTCUTS],
            "skip": ",".join(map(str, skip)),
            "skip_next": skip_next,
        },
    )


@require_GET
@permission_required(CAN_VIEW, raise_exception=True)
def labels_export(request: HttpRequest) -> StreamingHttpResponse:
    """Every failure label (?run=ID: of one run) as JSON Lines."""
    run = request.GET.get("run", "")
    run_id = int(run) if run.isdigit() else None

    def lines() -> Iterator[str]:
        for row in labels.labels_export(run_id=run_id):
            yield json.dumps(row) + "\n"

    response = StreamingHttpResponse(lines(), content_type="application/x-ndjson")
    name = f"labels-run-{run_id}.jsonl" if run_id else "labels.jsonl"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response
