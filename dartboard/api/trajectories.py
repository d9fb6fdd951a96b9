"""Trajectories: the list page's filters, one trajectory with its steps (screenshot URLs that
take the same token), and the curation actions, each one service call that records itself as
the dashboard's do (who reviewed it, the reward override's audit row, the label's author)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.http import FileResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from dartboard.api import schemas
from dartboard.api.base import ApiView, get_or_404, page_of, query_of
from dartboard.api.errors import ApiError, body, problem
from dartboard.forms import TrajectoryFilterForm
from dartboard.screenshots import screenshot_open
from datamanager.models import Trajectory
from datamanager.roles import CAN_ADMINISTER, CAN_CURATE
from datamanager.selectors.trajectories import (
    trajectories_with_task,
    trajectory_detail,
    trajectory_queryset,
)
from datamanager.services import labels, review

ERRORS = schemas.ERRORS


def _form_field_schema(field: forms.Field) -> dict[str, Any]:
    """A filter form field as the schema of its query parameter, with the bounds the field
    enforces (an empty value is refused before the form sees it: `known_params`)."""
    bounds = {
        "minimum": getattr(field, "min_value", None),
        "maximum": getattr(field, "max_value", None),
    }
    if isinstance(field, forms.ChoiceField):
        return {"type": "string", "enum": [c for c, _ in getattr(field, "choices", []) if c]}
    if isinstance(field, forms.BooleanField):
        return {"type": "boolean"}
    if isinstance(field, forms.DateTimeField):
        return {"type": "string", "format": "date-time"}
    if isinstance(field, forms.FloatField):  # before IntegerField: a subclass of it
        schema = {"type": "number", "format": "double", **bounds}
    elif isinstance(field, forms.IntegerField):
        schema = {"type": "integer", **bounds}
    elif isinstance(field, forms.CharField):  # which refuses a NUL, as `schemas.Text` does
        schema = {
            "type": "string",
            "minLength": 1,
            "maxLength": field.max_length,
            "pattern": schemas.NO_NUL,
        }
    else:  # a new kind of filter needs a branch here
        raise TypeError(f"no schema for the filter field {field!r}")
    return {key: value for key, value in schema.items() if value is not None}


def _filter_parameters() -> list[OpenApiParameter]:
    return [
        OpenApiParameter(name, _form_field_schema(field), description=str(field.label or name))
        for name, field in TrajectoryFilterForm().fields.items()
    ]


class TrajectoriesView(ApiView):
    @extend_schema(
        operation_id="trajectories_list",
        parameters=[*_filter_parameters(), schemas.Page],
        responses={200: schemas.TrajectoryListOut, **ERRORS},
    )
    def get(self, request: Request) -> Response:
        """Trajectories, newest first, filtered as the trajectory list page filters them."""
        form = TrajectoryFilterForm(request.query_params)
        paging = query_of(request, schemas.Page, also=form.fields)
        for name, field in form.fields.items():
            # The schema's boolean: true or false (the page's checkbox also sends "on").
            value = request.query_params.get(name)
            if isinstance(field, forms.BooleanField) and value not in (None, "true", "false"):
                raise ApiError(400, "invalid", f"{name} must be true or false", name)
        if not form.is_valid():
            problems = [
                problem("invalid", f"{name}: {' '.join(str(e) for e in errors)}", name)
                for name, errors in form.errors.items()
            ]
            return Response(body(problems), status=400)
        count, page = page_of(trajectory_queryset(flt=form.trajectory_filter()), paging)
        # The list page's queryset reads its own columns only; the API shows more of each.
        by_pk = trajectories_with_task(pks=[t.pk for t in page])
        ordered = [by_pk[t.pk] for t in page if t.pk in by_pk]
        return Response({"count": count, "results": schemas.TrajectoryOut(ordered, many=True).data})


class TrajectoryView(ApiView):
    @extend_schema(
        operation_id="trajectories_read",
        responses={200: schemas.TrajectoryDetailOut, 404: schemas.ErrorOut, **ERRORS},
    )
    def get(self, request: Request, trajectory_id: int) -> Response:
        """A trajectory with its steps: actions, thoughts, the policy's raw output and each
        step's screenshot URL."""
        try:
            traj, steps = trajectory_detail(trajectory_id=trajectory_id)
        except Trajectory.DoesNotExist:
            raise ApiError(404, "not_found", f"no trajectory {trajectory_id}") from None
        return Response(schemas.TrajectoryDetailOut(traj, context={"steps": steps}).data)


class CurateView(ApiView):
    """accept (into the experience pool), unpool, reject, trim, label, reward: one service
    call each; a refusal is a 409 with the service's reason."""

    write_permission = CAN_CURATE
    action = "accept"
    bodies: dict[str, type[serializers.Serializer]] = {
        "trim": schemas.Trim,
        "label": schemas.Label,
        "reward": schemas.Reward,
    }

    def curate(self, request: Request, trajectory_id: int) -> Response:
        traj = get_or_404(Trajectory, "trajectory", pk=trajectory_id)
        data = {}
        if self.action in self.bodies:
            parsed = self.bodies[self.action](data=request.data)
            parsed.is_valid(raise_exception=True)
            data = parsed.validated_data
        if self.action == "reward" and not request.user.has_perm(CAN_ADMINISTER):
            raise ApiError(403, "permission_denied", "only an admin may override a reward")
        try:
            result = self._apply(traj, data, request.user)
        except review.CurationError as exc:
            raise ApiError(409, "conflict", str(exc)) from None
        traj, steps = trajectory_detail(trajectory_id=result.pk)
        status = 201 if result.pk != trajectory_id else 200
        return Response(
            schemas.TrajectoryDetailOut(traj, context={"steps": steps}).data, status=status
        )

    def _apply(self, traj: Trajectory, data: dict, user) -> Trajectory:
        if self.action == "accept":
            return review.trajectory_promote(trajectory_id=traj.pk, user=user)
        if self.action == "unpool":
            return review.trajectory_unpool(trajectory_id=traj.pk)
        if self.action == "reject":
            return review.trajectory_reject(trajectory_id=traj.pk, user=user)
        if self.action == "trim":
            return review.trajectory_trim(trajectory_id=traj.pk, keep_steps=data["keep_steps"])
        if self.action == "label":
            labels.trajectory_label(
                trajectory_id=traj.pk,
                label=data["label"],
                comment=data.get("comment", ""),
                user=user,
            )
            return traj
        review.trajectory_override_reward(
            trajectory_id=traj.pk, reward=data["reward"], reason=data["reason"], user=user
        )
        return traj


def curate_view(action: str, summary: str):
    """The endpoint of one curation action, with its own schema."""
    request = CurateView.bodies.get(action)
    decorated = extend_schema(
        operation_id=f"trajectories_{action}",
        description=summary,
        request=request,
        responses={
            200: schemas.TrajectoryDetailOut,
            201: OpenApiResponse(schemas.TrajectoryDetailOut, description="The trimmed copy."),
            404: schemas.ErrorOut,
            409: schemas.ErrorOut,
            **ERRORS,
        },
    )

    def post(self: CurateView, request: Request, trajectory_id: int) -> Response:
        return self.curate(request, trajectory_id)

    view: Any = type(f"Curate{action.title()}View", (CurateView,), {"action": action})
    view.post = decorated(post)  # type: ignore[attr-defined]
    return view.as_view()


class ScreenshotView(ApiView):
    @extend_schema(
        operation_id="screenshots_read",
        responses={
            (200, "image/png"): OpenApiResponse(OpenApiTypes.BINARY),
            404: schemas.ErrorOut,
            **ERRORS,
        },
    )
    def get(self, request: Request, key: str) -> FileResponse:
        """A step's screenshot (PNG), by the URL its step gives."""
        opened = screenshot_open(key)
        if opened is None:
            raise ApiError(404, "not_found", f"no screenshot {key!r}")
        return FileResponse(opened, content_type="image/png")
