"""Tasks, evaluations (start one on a run's slots, read its report), hosts, and who you are."""

from __future__ import annotations

from django.db.models import Q
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from dartboard.api import schemas
from dartboard.api.base import ApiView, get_or_404, page_of, query_of
from dartboard.api.errors import ApiError
from datamanager.models import EvalJob, Run, Task
from datamanager.policies import EvalSetupError
from datamanager.roles import CAN_ADMINISTER, CAN_CONTROL, CAN_CREATE, CAN_CURATE, CAN_VIEW
from datamanager.selectors.dashboard import hosts_listing
from datamanager.selectors.evaluations import eval_jobs_listing
from datamanager.selectors.tasks import tasks_listing
from datamanager.services.evaluations import EvalNotStartable, eval_start
from datamanager.services.runs import NotYourRun

ERRORS = schemas.ERRORS
MAY = {
    "view": CAN_VIEW,
    "create": CAN_CREATE,
    "control": CAN_CONTROL,
    "curate": CAN_CURATE,
    "administer": CAN_ADMINISTER,
}


class TasksView(ApiView):
    @extend_schema(
        operation_id="tasks_list",
        parameters=[schemas.TasksQuery],
        responses={200: schemas.TaskListOut, **ERRORS},
    )
    def get(self, request: Request) -> Response:
        """Tasks by name."""
        query = query_of(request, schemas.TasksQuery)
        qs = tasks_listing()
        for name in ("split", "env_kind"):
            if name in query:
                qs = qs.filter(**{name: query[name]})
        if q := query.get("q", "").strip():
            qs = qs.filter(Q(name__icontains=q) | Q(tags__icontains=q))
        count, page = page_of(qs, query)
        return Response({"count": count, "results": schemas.TaskOut(page, many=True).data})


class TaskView(ApiView):
    @extend_schema(
        operation_id="tasks_read", responses={200: schemas.TaskOut, 404: schemas.ErrorOut, **ERRORS}
    )
    def get(self, request: Request, task_id: int) -> Response:
        """A task: its backend, split, tags and instruction."""
        return Response(schemas.TaskOut(get_or_404(Task, "task", pk=task_id)).data)


class EvaluationsView(ApiView):
    @extend_schema(
        operation_id="evaluations_list",
        parameters=[schemas.EvaluationsQuery],
        responses={200: schemas.EvaluationListOut, **ERRORS},
    )
    def get(self, request: Request) -> Response:
        """Evaluation jobs, newest first."""
        query = query_of(request, schemas.EvaluationsQuery)
        count, page = page_of(eval_jobs_listing(run_id=query.get("run")), query)
        return Response({"count": count, "results": schemas.EvaluationOut(page, many=True).data})

    @extend_schema(
        operation_id="evaluations_start",
        request=schemas.EvaluationStart,
        responses={
            201: schemas.EvaluationDetailOut,
            404: schemas.ErrorOut,
            409: schemas.ErrorOut,
            **ERRORS,
        },
    )
    def post(self, request: Request) -> Response:
        """Evaluate a version of a running run (default: its newest) on one of its scopes
        now, on its env slots, as its scheduled evaluations run."""
        body = schemas.EvaluationStart(data=request.data)
        body.is_valid(raise_exception=True)
        d = body.validated_data
        get_or_404(Run, "run", pk=d["run"])
        try:
            job = eval_start(
                run_id=d["run"], scope=d["scope"], version=d.get("version"), user=request.user
            )
        except NotYourRun as exc:
            raise ApiError(403, "not_your_run", str(exc)) from None
        except (EvalNotStartable, EvalSetupError) as exc:
            raise ApiError(409, "not_startable", str(exc)) from None
        return Response(schemas.EvaluationDetailOut(job).data, status=status.HTTP_201_CREATED)


class EvaluationView(ApiView):
    @extend_schema(
        operation_id="evaluations_read",
        responses={200: schemas.EvaluationDetailOut, 404: schemas.ErrorOut, **ERRORS},
    )
    def get(self, request: Request, job_id: int) -> Response:
        """An evaluation job with its report (per task: success rate, its interval, pass@k,
        env errors apart) once it has finished."""
        return Response(
            schemas.EvaluationDetailOut(get_or_404(EvalJob, "evaluation", pk=job_id)).data
        )


class HostsView(ApiView):
    @extend_schema(operation_id="hosts_list", responses={200: schemas.HostOut(many=True), **ERRORS})
    def get(self, request: Request) -> Response:
        """The hosts whose agents place runs, with what they last reported."""
        return Response(schemas.HostOut(hosts_listing(), many=True).data)


class MeView(ApiView):
    @extend_schema(operation_id="me", responses={200: schemas.MeOut, **ERRORS})
    def get(self, request: Request) -> Response:
        """Who the token is for, their roles and what they may do."""
        user = request.user
        return Response(
            {
                "username": user.get_username(),
                "roles": sorted(user.groups.values_list("name", flat=True))
                + (["superuser"] if user.is_superuser else []),
                "may": [word for word, perm in MAY.items() if user.has_perm(perm)],
            }
        )
