"""Dashboard forms. The run form is generated from `datamanager.config.RunConfig`, so every
setting appears with its default and help text, and each problem `run_config_validate` finds
lands on its field."""

from __future__ import annotations

import dataclasses
import typing
from datetime import UTC, datetime
from typing import Any, Literal, get_args, get_origin

from django import forms
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm

from dartboard import login_throttle
from datamanager.archive import MAX_UPLOAD_BYTES
from datamanager.config import ConfigInvalid, RunConfig
from datamanager.demos.episodes import screen_size
from datamanager.models import (
    EnvKind,
    FailureKind,
    TrajectorySource,
    TrajectoryStatus,
)
from datamanager.selectors.trajectories import END_REASONS, TrajectoryFilter
from datamanager.services.runs import run_config_validate
from datamanager.services.tokens import DEFAULT_DAYS as DEFAULT_TOKEN_DAYS
from datamanager.services.tokens import MAX_DAYS as MAX_TOKEN_DAYS

_TITLES = {"": "Run", "tasks": "Tasks", "env": "Environments"}


def sections() -> list[str]:
    """RunConfig's nested settings groups (every dataclass-typed field), in order."""
    hints = typing.get_type_hints(RunConfig)
    return [
        f.name for f in dataclasses.fields(RunConfig) if dataclasses.is_dataclass(hints[f.name])
    ]


def section_title(section: str) -> str:
    return _TITLES.get(section, section.replace("_", " ").capitalize())


def _form_field(tp: Any, f: dataclasses.Field, default: Any) -> forms.Field:
    help_text = f.metadata.get("help", "")
    if get_origin(tp) is Literal:
        choices = [(c, c) for c in get_args(tp)]
        return forms.ChoiceField(choices=choices, initial=default, help_text=help_text)
    if tp is bool:
        return forms.BooleanField(required=False, initial=default, help_text=help_text)
    if tp is int:
        return forms.IntegerField(initial=default, help_text=help_text)
    if tp is float:
        return forms.FloatField(initial=default, help_text=help_text)
    if tp is str:
        # A setting whose default is empty (e.g. env.osworld_provider) may be left empty.
        return forms.CharField(
            initial=default, help_text=help_text, max_length=500, required=bool(default)
        )
    if get_origin(tp) is list:
        if f.name == "env_kinds":
            return forms.MultipleChoiceField(
                choices=EnvKind.choices,
                initial=default,
                required=False,
                widget=forms.CheckboxSelectMultiple,
                help_text=help_text,
            )
        return forms.CharField(
            required=False,
            initial=", ".join(default),
            help_text=f"{help_text} Comma-separated.",
        )
    raise TypeError(f"no form field for {tp!r}")  # a new config type needs a branch here


def config_fields() -> list[tuple[str, str, Any, dataclasses.Field]]:
    """(section, dotted name, type, dataclass field) for every RunConfig setting."""
    out: list[tuple[str, str, Any, dataclasses.Field]] = []
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            sub = hints[f.name]
            sub_hints = typing.get_type_hints(sub)
            out.extend(
                (f.name, f"{f.name}.{g.name}", sub_hints[g.name], g)
                for g in dataclasses.fields(sub)
            )
        else:
            out.append(("", f.name, hints[f.name], f))
    return out


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for section, name, _, _ in config_fields():
        if section:
            value = config.get(section, {}).get(name.split(".", 1)[1])
        else:
            value = config.get(name)
        if value is not None:
            flat[name] = (
                ", ".join(value) if isinstance(value, list) and "env_kinds" not in name else value
            )
    return flat


class RunForm(forms.Form):
    """Name + every RunConfig setting (dotted field names, e.g. 'trainer.lr')."""

    name = forms.CharField(max_length=200, help_text="A name to find the run by.")

    def __init__(
        self,
        *args: Any,
        from_config: dict[str, Any] | None = None,
        user: Any = None,
        **kwargs: Any,
    ):
        """`user`: who submits it; settings only an admin may choose are refused for others."""
        super().__init__(*args, **kwargs)
        self.user = user
        defaults = RunConfig().to_dict()
        for section, name, tp, f in config_fields():
            key = name.split(".", 1)[1] if section else name
            default = defaults[section][key] if section else defaults[key]
            self.fields[name] = _form_field(tp, f, default)
        if from_config:
            self.initial.update(_flatten(from_config))

    def sections(self) -> list[tuple[str, list[forms.BoundField]]]:
        groups: dict[str, list[forms.BoundField]] = {"": [self["name"]]}
        for section, name, _, _ in config_fields():
            groups.setdefault(section, []).append(self[name])
        return [(section_title(s), fields) for s, fields in groups.items()]

    def config_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {s: {} for s in sections()}
        for section, name, tp, _ in config_fields():
            if name not in self.cleaned_data:
                continue
            value = self.cleaned_data[name]
            if get_origin(tp) is list and isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            elif get_origin(tp) is list:
                value = list(value)
            if section:
                data[section][name.split(".", 1)[1]] = value
            else:
                data[name] = value
        return data

    def clean(self) -> dict[str, Any] | None:
        cleaned = super().clean()
        if self.errors:
            return cleaned
        try:
            self.config = run_config_validate(data=self.config_dict(), user=self.user)
        except ConfigInvalid as exc:
            for problem in exc.problems:
                field = problem.path if problem.path in self.fields else None
                self.add_error(field, problem.message if field else str(problem))
        return cleaned


class TaskOverrideForm(forms.Form):
    pinned_budget = forms.IntegerField(
        required=False, min_value=1, max_value=64, help_text="Empty: the curation rule decides."
    )
    boost = forms.FloatField(
        initial=1.0, min_value=0.01, max_value=100, help_text="Sampling weight multiplier."
    )
    retired = forms.BooleanField(required=False, help_text="Never sample this task again.")
    reason = forms.CharField(max_length=500, help_text="Recorded with your name and the time.")


class RewardOverrideForm(forms.Form):
    reward = forms.FloatField(min_value=0.0, max_value=1.0)
    reason = forms.CharField(max_length=1000, widget=forms.Textarea(attrs={"rows": 2}))


class TrimForm(forms.Form):
    keep_steps = forms.IntegerField(min_value=1, help_text="Steps kept from the start.")


class UploadForm(forms.Form):
    archive = forms.FileField(
        help_text="A .zip: Dartboard's manifest.json and screenshots, OSWorld result folders "
        "(at any depth), or AgentNet .jsonl lines with their images."
    )
    format = forms.ChoiceField(
        choices=[
            ("dartboard", "Dartboard archive"),
            ("osworld", "OSWorld result folders"),
            ("agentnet", "AgentNet lines"),
        ],
        initial="dartboard",
    )
    task = forms.CharField(
        required=False,
        max_length=200,
        help_text="Import every episode into this task (else each episode's own task id or name).",
    )
    screen = forms.CharField(
        required=False,
        max_length=11,
        help_text="OSWorld: the VM's screen as WxH when the screenshots were saved at another "
        "size (its pyautogui points are rescaled); empty: the screenshots' own size.",
    )
    accept = forms.BooleanField(
        required=False,
        initial=False,
        help_text="Accept now: successful ones join their task's experience pool. Otherwise "
        "they wait in the review queue.",
    )

    def clean_archive(self) -> Any:
        upload = self.cleaned_data["archive"]
        if upload.size > MAX_UPLOAD_BYTES:
            raise forms.ValidationError(
                f"the archive is {upload.size // 2**20} MiB; at most "
                f"{MAX_UPLOAD_BYTES // 2**20} MiB in one upload"
            )
        return upload

    def clean_screen(self) -> tuple[int, int] | None:
        try:
            return screen_size(self.cleaned_data["screen"])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None


def _choices(choices: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [("", "any"), *choices]


# The largest id a filter takes: a row's key is 64-bit (bigint on PostgreSQL, SQLite's
# integer), and a larger one through a foreign key is an error, not "no match", on either.
MAX_ID = 2**63 - 1
EARLIEST = datetime(1, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)


def _storable(value: datetime | None) -> datetime | None:
    """A bound as the database can compare it: one whose UTC time falls outside the years
    1 to 9999 (year 1 at +05:00) is the earliest or latest time there is."""
    if value is None:
        return None
    try:
        return value.astimezone(UTC)
    except OverflowError:
        return EARLIEST if value.year == 1 else LATEST


class TrajectoryFilterForm(forms.Form):
    run = forms.IntegerField(required=False, min_value=1, max_value=MAX_ID)
    task = forms.CharField(required=False, max_length=200)
    # Task names nest ("click-button" is part of "click-button-sequence"): links to one
    # task's episodes (the evaluation pages) ask for the exact name.
    task_exact = forms.BooleanField(required=False, label="Exact task name")
    eval_job = forms.IntegerField(required=False, min_value=1, max_value=MAX_ID, label="Evaluation")
    status = forms.ChoiceField(required=False, choices=_choices(TrajectoryStatus.choices))
    reward = forms.ChoiceField(
        required=False,
        choices=_choices(
            [("positive", "> 0"), ("zero", "0"), ("none", "none"), ("human", "overridden")]
        ),
    )
    source = forms.ChoiceField(required=False, choices=_choices(TrajectorySource.choices))
    policy_version = forms.IntegerField(required=False, min_value=0, label="Policy version")
    in_pool = forms.ChoiceField(
        required=False, choices=[("", "any"), ("yes", "in pool"), ("no", "not in pool")]
    )
    end = forms.ChoiceField(required=False, choices=_choices(END_REASONS), label="End reason")
    env_error = forms.ChoiceField(
        required=False,
        choices=[("", "any"), ("yes", "env error"), ("no", "no env error")],
        label="Env error",
    )
    label = forms.ChoiceField(
        required=False, choices=_choices([*FailureKind.choices, ("none", "unlabelled")])
    )
    reward_min = forms.FloatField(required=False, label="Reward ≥")
    reward_max = forms.FloatField(required=False, label="Reward <")
    entropy_min = forms.FloatField(required=False, min_value=0, label="A step's entropy ≥")
    entropy_max = forms.FloatField(required=False, min_value=0, label="and ≤")
    is_weight_min = forms.FloatField(required=False, min_value=0, label="A step's IS weight ≥")
    is_weight_max = forms.FloatField(required=False, min_value=0, label="and ≤")
    group = forms.IntegerField(required=False, min_value=1, max_value=MAX_ID, label="Group")
    host = forms.CharField(required=False, max_length=200, label="Host")
    update = forms.IntegerField(required=False, min_value=1, label="Trained in update")
    finished_from = forms.DateTimeField(required=False, label="Finished from")
    finished_to = forms.DateTimeField(required=False, label="to (before)")
    reviewed = forms.ChoiceField(
        required=False,
        choices=[("", "any"), ("yes", "reviewed"), ("no", "not reviewed")],
        label="Reviewed",
    )

    def clean_finished_from(self) -> datetime | None:
        return _storable(self.cleaned_data["finished_from"])

    def clean_finished_to(self) -> datetime | None:
        return _storable(self.cleaned_data["finished_to"])

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        for low, high in (
            ("reward_min", "reward_max"),
            ("entropy_min", "entropy_max"),
            ("is_weight_min", "is_weight_max"),
            ("finished_from", "finished_to"),
        ):
            lo, hi = data.get(low), data.get(high)
            if lo is not None and hi is not None and lo > hi:
                self.add_error(high, f"must not be below {low} ({lo})")
        return data

    def trajectory_filter(self) -> TrajectoryFilter:
        """The filter a valid form asks for (the list page's and the API's)."""
        d = self.cleaned_data
        yes_no = {"yes": True, "no": False}
        return TrajectoryFilter(
            run_id=d["run"],
            task=d["task"],
            task_exact=d["task_exact"],
            eval_job_id=d["eval_job"],
            status=d["status"],
            reward=d["reward"],
            source=d["source"],
            policy_version=d["policy_version"],
            in_pool=yes_no.get(d["in_pool"]),
            end=d["end"],
            env_error=yes_no.get(d["env_error"]),
            label=d["label"],
            reward_min=d["reward_min"],
            reward_max=d["reward_max"],
            entropy_min=d["entropy_min"],
            entropy_max=d["entropy_max"],
            is_weight_min=d["is_weight_min"],
            is_weight_max=d["is_weight_max"],
            group_id=d["group"],
            host=d["host"],
            update=d["update"],
            finished_from=d["finished_from"],
            finished_to=d["finished_to"],
            reviewed=yes_no.get(d["reviewed"]),
        )


class EvalJobFilterForm(forms.Form):
    run = forms.IntegerField(required=False, min_value=1)


class EvalCompareForm(forms.Form):
    a = forms.IntegerField(min_value=1, label="Job A")
    b = forms.IntegerField(min_value=1, label="Job B")


class _Throttled:
    """A login form's clean() behind dartboard.login_throttle: a pair (username, client
    address) past its failures is refused before the password is checked; `retry_after` then
    holds the seconds to wait."""

    request: Any
    cleaned_data: dict[str, Any]
    retry_after: int | None = None

    def clean(self) -> dict[str, Any]:
        username = str(self.cleaned_data.get("username") or "")
        address = login_throttle.client_address(self.request)
        wait = login_throttle.login_retry_after(username=username, address=address)
        if wait is not None:
            self.retry_after = wait
            raise forms.ValidationError(
                f"Too many failed logins as {username} from your address: try again in "
                f"{login_throttle.wait_words(wait)}.",
                code="throttled",
            )
        try:
            cleaned = super().clean()  # type: ignore[misc]
        except forms.ValidationError:
            if username:
                login_throttle.login_failed(username=username, address=address)
            raise
        login_throttle.login_succeeded(username=username, address=address)
        return cleaned


class LoginForm(_Throttled, AuthenticationForm):
    """The dashboard's login."""


class AdminLoginForm(_Throttled, AdminAuthenticationForm):
    """The admin site's login (staff only), throttled the same way."""


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What it is for, e.g. 'laptop notebook'.")
    days = forms.IntegerField(
        min_value=1,
        max_value=MAX_TOKEN_DAYS,
        initial=DEFAULT_TOKEN_DAYS,
        help_text=f"Days it works (at most {MAX_TOKEN_DAYS}).",
    )
