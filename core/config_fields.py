"""How a run config's fields are declared, parsed and checked: `knob` declares a field with
its help; `check` and its kin report a problem under the field's dotted path; `build_all`
builds a config dataclass from JSON and raises every problem at once (`ConfigInvalid`).
The settings themselves are `datamanager.config`'s, their trainer and curation sections
`training.config`'s (here, below both, so the trainer declares its own).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from contextvars import ContextVar
from dataclasses import field
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A config value is invalid. `path` is the dotted field name, e.g. 'trainer.lr'."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


class ConfigInvalid(ConfigError):
    """Every problem of a config, in the order of its fields (`problems`); `path` and
    `message` are the first one's, so a caller that shows one problem shows that."""

    def __init__(self, problems: list[ConfigError]) -> None:
        ValueError.__init__(self, "; ".join(str(p) for p in problems))
        self.path = problems[0].path
        self.message = problems[0].message
        self.problems = problems


# The problems `build_all` collects while it builds a config (None outside it: a
# check raises at once, as when a dataclass is built in code).
_collected: ContextVar[list[ConfigError] | None] = ContextVar("config_problems", default=None)


def problem(error: ConfigError) -> None:
    collected = _collected.get()
    if collected is None:
        raise error
    collected.append(error)


def knob(default: Any, help: str) -> Any:  # noqa: A002  (help text, not builtins.help)
    """A config field with its one-line help (shown in the run form)."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def unused_knob(obj: Any, name: str, why: str) -> None:
    """A knob set away from its default where it does nothing is an error, not a silent no-op."""
    f = next(f for f in dataclasses.fields(obj) if f.name == name)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    check(getattr(obj, name) == default, name, f"has no effect {why}; leave it at {default}")


def check(cond: bool, path: str, message: str) -> None:
    if not cond:
        problem(ConfigError(path, message))


def config_override(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of config JSON `data` with the setting at dotted `path` ("trainer.lr") set to
    `value`: how a copy, `--set` and a sweep's grid change one setting. Whether the path and
    the value are valid is `from_dict`'s to say."""
    out = dict(data)
    head, _, rest = path.partition(".")
    if not rest:
        out[head] = value
        return out
    inner = out.get(head)
    out[head] = config_override(inner if isinstance(inner, dict) else {}, rest, value)
    return out


def _build(cls: type, data: Any, prefix: str) -> Any:
    """An instance of dataclass `cls` from `data`, its problems reported (`_problem`) with
    `prefix` before their paths; None when `data` is not an object at all."""
    if not isinstance(data, dict):
        problem(ConfigError(prefix.rstrip("."), f"must be an object, got {type(data).__name__}"))
        return None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for name in sorted(set(data) - names, key=str):
        problem(
            ConfigError(prefix + str(name), f"unknown setting (known: {', '.join(sorted(names))})")
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        try:
            value = _coerce(hints[f.name], data[f.name], prefix + f.name)
        except ConfigError as exc:
            problem(exc)
            continue
        if value is not None:
            kwargs[f.name] = value
    collected = _collected.get()
    before = len(collected) if collected is not None else 0
    try:
        built = cls(**kwargs)
    except ConfigError as exc:  # raised at once: built outside `from_dict`
        if exc.path.startswith(prefix) and prefix:
            raise
        raise ConfigError(prefix + exc.path, exc.message) from None
    if collected is not None and prefix:  # this class's own checks name its fields only
        for i in range(before, len(collected)):
            found = collected[i]
            collected[i] = ConfigError(prefix + found.path, found.message)
    return built


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, path + ".")
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool) and "on" in choices and "off" in choices:
            value = "on" if value else "off"  # a switch that gained `auto` takes true/false
        if value not in choices:
            raise ConfigError(path, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin in (list, types.GenericAlias) or tp is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(path, f"must be a list of strings, got {value!r}")
        return list(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    raise ConfigError(path, f"unsupported type {tp!r}")  # a programming error in this module


def build_all(cls: type, data: dict[str, Any] | None) -> Any:
    """An instance of config dataclass `cls` from (partial) JSON, missing fields at their
    defaults. Raises ConfigInvalid with every problem: a value of the wrong type or an unknown
    setting is left out (its default stands in) so the checks of the rest still run."""
    problems: list[ConfigError] = []
    token = _collected.set(problems)
    try:
        config = _build(cls, data or {}, "")
    finally:
        _collected.reset(token)
    if problems:
        raise ConfigInvalid(problems)
    return config
