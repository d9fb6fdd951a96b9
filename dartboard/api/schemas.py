"""Request and response shapes of the API: DRF serializers, from which drf-spectacular writes
the OpenAPI schema. Inputs are parsed here; whether a run's settings are valid is
`run_config_validate`'s to say (the form's rules), so the schema describes `config` from
`RunConfig` itself (`run_config_schema`) and the server answers every problem at once."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal
from urllib.parse import urlencode

from django.urls import reverse
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from dartboard.forms import MAX_ID
from datamanager.config import RunConfig
from datamanager.models import (
    EnvKind,
    EnvSlot,
    EvalJob,
    EvalScope,
    FailureKind,
    Host,
    Run,
    RunPlacement,
    RunProcessLog,
    RunStatus,
    Split,
    Step,
    Sweep,
    SweepMember,
    Task,
    Trajectory,
)
from datamanager.selectors.tasks import osworld_task_missing_files, osworld_task_needs
from datamanager.services.sweeps import MAX_MEMBERS, MAX_PARALLEL

MAX_PAGE = 500
MAX_OFFSET = 2**31
# No NUL in any string the API takes: PostgreSQL's text cannot hold one, and DRF's and
# Django's string fields refuse it on every database. "+", not "*": a string that may be
# empty is drf-spectacular's oneOf [this, maxLength 0], whose two must not both match ""
# (nor may such a string have a default: drf-spectacular puts it in the first).
NO_NUL = r"^[^\x00]+$"


def _field_schema(tp: Any, f: dataclasses.Field | None) -> dict[str, Any]:
    out: dict[str, Any]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        out = _dataclass_schema(tp)
    elif typing.get_origin(tp) is Literal:
        out = {"type": "string", "enum": list(typing.get_args(tp))}
    elif tp is bool:
        out = {"type": "boolean"}
    elif tp is int:
        out = {"type": "integer"}
    elif tp is float:
        out = {"type": "number"}
    elif tp is str:
        out = {"type": "string"}
    elif typing.get_origin(tp) is list:
        out = {"type": "array", "items": {"type": "string"}}
    else:  # a new config type needs a branch here
        raise TypeError(f"no schema for {tp!r}")
    if f is not None and not dataclasses.is_dataclass(tp):
        out["description"] = f.metadata.get("help", "")
        factory = typing.cast(Any, f.default_factory)
        out["default"] = f.default if f.default is not dataclasses.MISSING else factory()
    return out


def _dataclass_schema(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {f.name: _field_schema(hints[f.name], f) for f in dataclasses.fields(cls)},
    }


def run_config_schema() -> dict[str, Any]:
    """RunConfig as JSON Schema: every setting with its type, default and help; a setting
    left out takes its default (docs/reference/settings.md)."""
    return {
        **_dataclass_schema(RunConfig),
        "description": "A run's settings; what is left out takes its default.",
    }


class ConfigField(serializers.JSONField):
    """A run's settings: passed on as given, checked by `run_config_validate`."""


class ConfigFieldSchema(OpenApiSerializerFieldExtension):
    """`ConfigField` in the schema: the component RunConfig (`run_config_schema`)."""

    target_class = ConfigField

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        component = ResolvedComponent(
            name="RunConfig",
            type=ResolvedComponent.SCHEMA,
            object="RunConfig",
            schema=run_config_schema(),
        )
        auto_schema.registry.register_on_missing(component)
        return component.ref


@extend_schema_field(
    {
        "type": "object",
        "additionalProperties": {},
        "description": 'Settings to change, by dotted name: {"trainer.lr": 1e-05}.',
    }
)
class OverridesField(serializers.DictField):
    pass


# ------------------------------------------------------------------ inputs


class Text(serializers.CharField):
    """A string exactly as sent: not trimmed (the schema's minLength counts the spaces), never
    with a NUL (the schema's pattern says so: `TextSchema`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(trim_whitespace=False, **kwargs)


class TextSchema(OpenApiSerializerFieldExtension):
    """`Text` in the schema: a string field's schema with the NUL it refuses ruled out."""

    target_class = Text

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema = auto_schema._map_serializer_field(self.target, direction, bypass_extensions=True)
        return {**schema, "pattern": NO_NUL}


# A body field's JSON types, as its schema's `type` states them (bool is an int in Python).
_JSON_TYPES: list[tuple[type[serializers.Field], tuple[type, ...], str]] = [
    (serializers.BooleanField, (bool,), "true or false"),
    (serializers.IntegerField, (int, float), "a whole number"),
    (serializers.FloatField, (int, float), "a number"),
    (serializers.CharField, (str,), "a string"),
]


def _is_json_type(value: Any, types: tuple[type, ...], field: serializers.Field) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False
    if isinstance(field, serializers.IntegerField) and isinstance(value, float):
        return value.is_integer()  # 5.0 is an integer to JSON Schema
    return isinstance(value, types)


class Body(serializers.Serializer):
    # A request body whose fields take their schema's JSON type only: DRF's own fields would
    # take "5" for a whole number, 1 or "yes" for true, 5 for a string, each of which the
    # schema refuses (YAML's `name: 2024` is a number: quote it). (No docstring: the schema
    # would give it to every body without one of its own.)

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            problems = {}
            for name, field in self.fields.items():
                value = data.get(name)
                for cls, types, words in _JSON_TYPES:
                    if isinstance(field, cls):
                        if value is not None and not _is_json_type(value, types, field):
                            problems[name] = [f"must be {words}, not {type(value).__name__}"]
                        break
            if problems:
                raise serializers.ValidationError(problems)
        return super().to_internal_value(data)


class RunCreate(Body):
    name = Text(max_length=200, help_text="A name to find the run by.")
    config = ConfigField(required=False, default=dict)
    overrides = OverridesField(required=False, default=dict)
    start = serializers.BooleanField(
        default=False, help_text="Start it at once (queued while it does not fit)."
    )


class RunCopy(Body):
    name = Text(max_length=200, required=False, help_text="Default: the run's name and ' (copy)'.")
    overrides = OverridesField(required=False, default=dict)
    start = serializers.BooleanField(default=False)


class SweepCreate(Body):
    name = Text(max_length=150)
    config = ConfigField(required=False, default=dict)
    overrides = OverridesField(required=False, default=dict)
    grid = serializers.DictField(
        child=serializers.ListField(child=serializers.JSONField(allow_null=True), min_length=1),
        required=False,
        default=dict,
        help_text='Values per setting, e.g. {"trainer.lr": [1e-05, 5e-05]}: a run for each '
        "combination and seed.",
    )
    seeds = serializers.IntegerField(
        default=1,
        min_value=1,
        max_value=MAX_MEMBERS,
        help_text="Seeds per combination: seed, seed + 1, ... (the config's seed).",
    )
    parallel = serializers.IntegerField(
        default=1,
        min_value=1,
        max_value=MAX_PARALLEL,
        help_text="Members queued or running at once; the next starts as one ends.",
    )


class EvaluationStart(Body):
    run = serializers.IntegerField(min_value=1)
    scope = serializers.ChoiceField(choices=EvalScope.choices)
    version = serializers.IntegerField(
        min_value=0, required=False, help_text="Default: the run's newest version."
    )


class Trim(Body):
    keep_steps = serializers.IntegerField(min_value=1, help_text="Steps kept from the start.")


class Label(Body):
    label = serializers.ChoiceField(choices=FailureKind.choices)
    comment = Text(required=False, allow_blank=True)


class Reward(Body):
    reward = serializers.FloatField(min_value=0.0, max_value=1.0)
    reason = Text(max_length=1000)


# Query parameters: each list endpoint's are a serializer, which both parses them and gives
# the schema its parameters (`extend_schema(parameters=[...])`), so the two cannot drift.


class Page(serializers.Serializer):
    limit = serializers.IntegerField(
        min_value=1, max_value=MAX_PAGE, default=50, help_text="Results on the page."
    )
    offset = serializers.IntegerField(
        min_value=0, max_value=MAX_OFFSET, default=0, help_text="Results skipped before it."
    )


class RunsQuery(Page):
    status = serializers.ChoiceField(choices=RunStatus.choices, required=False)
    owner = Text(required=False, help_text="The owner's username.")
    sweep = serializers.IntegerField(min_value=1, max_value=MAX_ID, required=False)


class TasksQuery(Page):
    split = serializers.ChoiceField(choices=Split.choices, required=False)
    env_kind = serializers.ChoiceField(choices=EnvKind.choices, required=False)
    q = Text(required=False, help_text="A part of the name or a tag.")


class EvaluationsQuery(Page):
    run = serializers.IntegerField(min_value=1, max_value=MAX_ID, required=False)


class ProcessLogQuery(serializers.Serializer):
    host = Text(
        required=False,
        max_length=200,
        help_text="The host the process runs on; needed only where the run has a process of "
        "that name on several hosts.",
    )


# ------------------------------------------------------------------ outputs


class PlacementOut(serializers.ModelSerializer):
    host = serializers.CharField(source="host.name", allow_null=True, default=None)

    class Meta:
        model = RunPlacement
        fields = ["host", "state", "reason", "router_url", "plan", "queued_at"]


class RunOut(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", allow_null=True, default=None)
    config = ConfigField()
    placement = serializers.SerializerMethodField()
    queue_reason = serializers.SerializerMethodField()
    sweep = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField()

    class Meta:
        model = Run
        fields = [
            "id",
            "name",
            "status",
            "status_message",
            "owner",
            "created_at",
            "started_at",
            "finished_at",
            "config",
            "placement",
            "queue_reason",
            "sweep",
            "url",
        ]

    @extend_schema_field(PlacementOut(allow_null=True))
    def get_placement(self, run: Run) -> dict[str, Any] | None:
        placement = getattr(run, "placement", None)
        return PlacementOut(placement).data if placement is not None else None

    def get_queue_reason(self, run: Run) -> str:
        """Why a queued run waits (empty unless it is queued)."""
        if run.status != RunStatus.QUEUED:
            return ""
        placement = getattr(run, "placement", None)
        return (placement.reason if placement is not None else "") or run.status_message

    def get_sweep(self, run: Run) -> int | None:
        member = getattr(run, "sweep_member", None)
        return member.sweep_id if member is not None else None

    def get_url(self, run: Run) -> str:
        return reverse("run_detail", args=[run.pk])


class RunBriefOut(serializers.ModelSerializer):
    class Meta:
        model = Run
        fields = ["id", "name", "status", "status_message", "started_at", "finished_at"]


class RunListOut(serializers.Serializer):
    count = serializers.IntegerField()
    results = RunOut(many=True)


class GreedyPointOut(serializers.Serializer):
    scope = serializers.ChoiceField(choices=EvalScope.choices)
    version = serializers.IntegerField()
    ok = serializers.IntegerField(help_text="Episodes that succeeded.")
    scored = serializers.IntegerField(help_text="Episodes that succeeded or failed.")
    rate = serializers.FloatField()
    low = serializers.FloatField(help_text="The 95% Wilson interval's low end.")
    high = serializers.FloatField()


class SeriesOut(serializers.Serializer):
    t = serializers.ListField(child=serializers.CharField(allow_null=True))
    values = serializers.ListField(child=serializers.FloatField(allow_null=True))


class ThroughputOut(serializers.Serializer):
    t = serializers.ListField(child=serializers.CharField())
    actions_per_min = serializers.ListField(child=serializers.FloatField())
    trajectories_per_min = serializers.ListField(child=serializers.FloatField())


class UpdatesOut(serializers.Serializer):
    number = serializers.ListField(child=serializers.IntegerField())
    series = serializers.DictField(
        child=serializers.ListField(child=serializers.FloatField(allow_null=True)),
        help_text="metric -> a value per update (null: not measured), e.g. loss, kl, "
        "logprob_gap_mean",
    )


class LogprobGapOut(serializers.Serializer):
    number = serializers.ListField(child=serializers.IntegerField())
    mean = serializers.ListField(child=serializers.FloatField(allow_null=True))
    p99 = serializers.ListField(child=serializers.FloatField(allow_null=True))
    alert = serializers.FloatField(help_text="trainer.logprob_gap_alert (0: off).")


class MetricsOut(serializers.Serializer):
    run = serializers.IntegerField()
    bucket = serializers.CharField(help_text="The time series' bucket width.")
    greedy = GreedyPointOut(many=True)
    success = SeriesOut(help_text="Success rate of the finished training rollouts per bucket.")
    throughput = ThroughputOut()
    updates = UpdatesOut()
    logprob_gap = LogprobGapOut()


class TrajectoryOut(serializers.ModelSerializer):
    task = serializers.CharField(source="task.name")
    url = serializers.SerializerMethodField()

    class Meta:
        model = Trajectory
        fields = [
            "id",
            "run",
            "task",
            "status",
            "reward",
            "reward_source",
            "length",
            "source",
            "purpose",
            "in_pool",
            "rejected",
            "started_at",
            "finished_at",
            "policy_versions",
            "error",
            "eval_job",
            "group",
            "seed",
            "url",
        ]

    def get_url(self, traj: Trajectory) -> str:
        return reverse("trajectory_detail", args=[traj.pk])


class TrajectoryListOut(serializers.Serializer):
    count = serializers.IntegerField()
    results = TrajectoryOut(many=True)


class StepOut(serializers.ModelSerializer):
    screenshot_url = serializers.SerializerMethodField(
        help_text="The screen the policy saw; send the same token to fetch it."
    )
    trained_in_update = serializers.IntegerField(
        source="trained_in_update.number", allow_null=True, default=None
    )

    class Meta:
        model = Step
        fields = [
            "index",
            "thought",
            "action",
            "raw_output",
            "parse_error",
            "screenshot_url",
            "screen_width",
            "screen_height",
            "policy_version",
            "mean_entropy",
            "advantage",
            "is_weight",
            "stale",
            "trained_in_update",
            "env_ms",
            "model_ms",
        ]

    def get_screenshot_url(self, step: Step) -> str | None:
        if not step.screenshot:
            return None
        return reverse("api_screenshot", args=[step.screenshot.name])


class LabelOut(serializers.Serializer):
    label = serializers.CharField()
    comment = serializers.CharField()
    user = serializers.CharField(source="user.username", allow_null=True, default=None)
    created_at = serializers.DateTimeField()


class RewardOverrideOut(serializers.Serializer):
    old_reward = serializers.FloatField(allow_null=True)
    new_reward = serializers.FloatField()
    reason = serializers.CharField()
    user = serializers.CharField(source="user.username", allow_null=True, default=None)
    created_at = serializers.DateTimeField()


class TrajectoryDetailOut(TrajectoryOut):
    steps = serializers.SerializerMethodField()
    label = serializers.SerializerMethodField()
    reward_overrides = serializers.SerializerMethodField()

    class Meta(TrajectoryOut.Meta):
        fields = [
            *TrajectoryOut.Meta.fields,
            "instruction",
            "details",
            "curated_from",
            "label",
            "reward_overrides",
            "steps",
        ]

    @extend_schema_field(StepOut(many=True))
    def get_steps(self, traj: Trajectory) -> list[dict[str, Any]]:
        return list(StepOut(self.context["steps"], many=True).data)

    @extend_schema_field(LabelOut(allow_null=True))
    def get_label(self, traj: Trajectory) -> dict[str, Any] | None:
        label = getattr(traj, "failure_label", None)
        return LabelOut(label).data if label is not None else None

    @extend_schema_field(RewardOverrideOut(many=True))
    def get_reward_overrides(self, traj: Trajectory) -> list[dict[str, Any]]:
        rows = traj.reward_overrides.select_related("user").order_by("created_at")
        return list(RewardOverrideOut(rows, many=True).data)


class TaskOut(serializers.ModelSerializer):
    needs = serializers.SerializerMethodField(
        help_text="What an osworld task needs of its slot (app:chrome, internet, ...); "
        "a run places it only on VMs offering all of it (env.osworld_offers)."
    )
    missing_files = serializers.SerializerMethodField(
        help_text="URLs of an osworld task's files that this host's file cache lacks "
        "(`manage.py osworld_cache fetch`); a run with the task is refused until it has them."
    )

    class Meta:
        model = Task
        fields = [
            "id",
            "name",
            "env_kind",
            "split",
            "tags",
            "instruction",
            "needs",
            "missing_files",
        ]

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_needs(self, task: Task) -> list[str]:
        return osworld_task_needs(task)

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_missing_files(self, task: Task) -> list[str]:
        return osworld_task_missing_files(task)


class TaskListOut(serializers.Serializer):
    count = serializers.IntegerField()
    results = TaskOut(many=True)


class EvaluationOut(serializers.ModelSerializer):
    class Meta:
        model = EvalJob
        fields = [
            "id",
            "name",
            "policy",
            "run",
            "policy_version",
            "scope",
            "status",
            "done",
            "total",
            "k",
            "seed",
            "greedy",
            "error",
            "created_at",
            "finished_at",
        ]


class EvaluationDetailOut(EvaluationOut):
    class Meta(EvaluationOut.Meta):
        fields = [*EvaluationOut.Meta.fields, "task_names", "report"]


class EvaluationListOut(serializers.Serializer):
    count = serializers.IntegerField()
    results = EvaluationOut(many=True)


class HostOut(serializers.ModelSerializer):
    class Meta:
        model = Host
        fields = [
            "id",
            "name",
            "address",
            "gpus",
            "cuda_torch",
            "cpu_cores",
            "memory_gib",
            "cpu_inference_slots",
            "env_kinds",
            "last_seen",
        ]


class ProcessLogOut(serializers.ModelSerializer):
    url = serializers.SerializerMethodField()

    class Meta:
        model = RunProcessLog
        fields = ["host", "process", "size", "running", "updated_at", "url"]

    def get_url(self, row: RunProcessLog) -> str:
        """The log's tail, as text (`runs_log`)."""
        path = reverse("api_run_log", args=[row.run_id, row.process])
        return f"{path}?{urlencode({'host': row.host})}"


class SlotOut(serializers.ModelSerializer):
    class Meta:
        model = EnvSlot
        fields = [
            "name",
            "key",
            "host",
            "backend",
            "status",
            "run",
            "current_trajectory",
            "last_heartbeat",
            "consecutive_failures",
            "last_error",
            "env_busy_s",
        ]


class SweepMemberOut(serializers.ModelSerializer):
    run = RunBriefOut()

    class Meta:
        model = SweepMember
        fields = ["index", "overrides", "launched_at", "run"]


class SweepOut(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", allow_null=True, default=None)
    config = ConfigField()
    members = SweepMemberOut(many=True)
    url = serializers.SerializerMethodField()

    class Meta:
        model = Sweep
        fields = [
            "id",
            "name",
            "owner",
            "created_at",
            "stopped_at",
            "config",
            "grid",
            "seeds",
            "parallel",
            "members",
            "url",
        ]

    def get_url(self, sweep: Sweep) -> str:
        return reverse("sweep_detail", args=[sweep.pk])


class SweepListOut(serializers.Serializer):
    count = serializers.IntegerField()
    results = SweepOut(many=True)


class MeOut(serializers.Serializer):
    username = serializers.CharField()
    roles = serializers.ListField(child=serializers.CharField())
    may = serializers.ListField(
        child=serializers.CharField(), help_text="view, create, control, curate, administer"
    )


class ErrorItemOut(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    field = serializers.CharField(allow_null=True)


class ErrorOut(ErrorItemOut):
    errors = ErrorItemOut(many=True)


# The refusals any endpoint may answer (dartboard/api/errors.py): bad input, no or a dead
# token, a role that may not, a body past the limit, too many writes.
ERRORS = {status: ErrorOut for status in (400, 401, 403, 413, 429)}


_DATABASE_BOUNDS = {2**31 - 1, -(2**31), 2**63 - 1, -(2**63)}


def without_database_ranges(result: dict, generator: Any, request: Any, public: bool) -> dict:
    """drf-spectacular postprocessing hook: drop the bounds and int32/int64 formats a model
    field's integer column gets from the database in use, so the published schema is the one
    every deployment serves (SQLite's integers are 64-bit, PostgreSQL's integer 32-bit).
    Only the responses' components have such columns: a query parameter's bounds are the
    API's own (an id's `MAX_ID` the same on both), and stay."""

    def walk(node: Any, drop_bounds: bool) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer":
                for key in ("maximum", "minimum"):
                    if drop_bounds and node.get(key) in _DATABASE_BOUNDS:
                        del node[key]
                if node.get("format") in ("int32", "int64"):
                    del node["format"]
            for value in node.values():
                walk(value, drop_bounds)
        elif isinstance(node, list):
            for value in node:
                walk(value, drop_bounds)

    walk(result["paths"], drop_bounds=False)
    walk(result.get("components", {}), drop_bounds=True)
    return result
