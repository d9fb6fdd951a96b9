"""Every run knob reaches the code it is meant to change, or says where it is read; a knob
that would do nothing under the chosen setting is refused with its field named."""

from __future__ import annotations

import dataclasses
import itertools
import math
import typing
from typing import Any, get_args

import pytest

from datamanager.config import ConfigError, RunConfig
from workers.config_mapping import READ_ELSEWHERE, episode_config


def leaf_fields(cls: type = RunConfig, prefix: str = "") -> dict[str, Any]:
    """'section.name' -> type hint of every leaf field of the run config."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(leaf_fields(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = hints[f.name]
    return out


def read_elsewhere(path: str) -> bool:
    return path in READ_ELSEWHERE or f"{path.split('.')[0]}.*" in READ_ELSEWHERE


def other_value(hint: Any, value: Any) -> Any:
    """A valid value different from the default."""
    if hint is bool:
        return not value
    choices = get_args(hint)
    if choices and all(isinstance(c, str) for c in choices):
        return next(c for c in choices if c != value)
    if hint is int or isinstance(value, int):
        return value + 1
    return value * 0.5 if value else 0.5


def mapped_outputs(cfg: RunConfig) -> Any:
    return episode_config(cfg, step_cap=5, seed=1)


def with_field(path: str, value: Any) -> RunConfig:
    section, _, name = path.rpartition(".")
    data: dict[str, Any] = {name: value}
    if section:
        data = {section: data}
    return RunConfig.from_dict(data)


MAPPED = [p for p in leaf_fields() if not read_elsewhere(p)]
UI_TARS = {"prompt": "ui-tars-1.5", "max_new_tokens": 512, "max_prompt_tokens": 16384}


def test_every_run_knob_is_mapped_or_says_where_it_is_read() -> None:
    stale = [p for p in READ_ELSEWHERE if not p.endswith(".*") and p not in leaf_fields()]
    assert not stale, f"READ_ELSEWHERE names fields the run config no longer has: {stale}"
    assert "rollout.max_images" in MAPPED and "rollout.temperature" in MAPPED
    # The trainer takes its section as it is: nothing mapped, each knob's reader named.
    assert not [p for p in MAPPED if p.startswith("trainer.")]
    for path in ("trainer.ppo_epochs", "trainer.gspo_clip_low", "trainer.lr", "curation.is_cap"):
        assert READ_ELSEWHERE[path].startswith("training."), path


@pytest.mark.parametrize("path", MAPPED)
def test_a_mapped_knob_changes_what_rollout_receives(path: str) -> None:
    hints = leaf_fields()
    default = RunConfig()
    section, _, name = path.rpartition(".")
    value = getattr(getattr(default, section) if section else default, name)
    if path == "rollout.language":  # only the UI-TARS-1.5 template has a language line
        changed = RunConfig.from_dict({"rollout": {**UI_TARS, name: "Chinese"}})
        default = RunConfig.from_dict({"rollout": UI_TARS})
    elif path == "rollout.prompt":
        changed = RunConfig.from_dict({"rollout": UI_TARS})
    else:
        changed = with_field(path, other_value(hints[path], value))
    assert mapped_outputs(changed) != mapped_outputs(default), f"{path} reaches nothing"


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"trainer": {"loss_type": "gspo", "clip_low": 0.1}}, "trainer.clip_low"),
        ({"trainer": {"loss_type": "gspo", "clip_high": 0.3}}, "trainer.clip_high"),
        ({"trainer": {"gspo_clip_high": 0.01}}, "trainer.gspo_clip_high"),
        ({"curation": {"truncated_is": False, "is_cap": 2.0}}, "curation.is_cap"),
        ({"curation": {"high_entropy": False, "entropy_top_q": 0.5}}, "curation.entropy_top_q"),
        ({"curation": {"dynamic_budget": False, "n_min": 3}}, "curation.n_min"),
        ({"rollout": {"language": "Chinese"}}, "rollout.language"),
        ({"trainer": {"lora_alpha": 16}}, "trainer.lora_alpha"),
        ({"trainer": {"lora_vision": True}}, "trainer.lora_vision"),
        ({"trainer": {"lr_decay_updates": 40}}, "trainer.lr_decay_updates"),
        ({"trainer": {"lr_min_ratio": 0.5}}, "trainer.lr_min_ratio"),
    ],
)
def test_a_knob_that_does_nothing_under_the_chosen_setting_is_refused(
    data: dict, field: str
) -> None:
    with pytest.raises(ConfigError, match="has no effect") as caught:
        RunConfig.from_dict(data)
    assert caught.value.path == field


def test_evaluation_and_rollout_share_the_run_settings() -> None:
    cfg = RunConfig.from_dict({"rollout": {"max_images": 2, "max_new_tokens": 40}})
    greedy = episode_config(cfg, step_cap=7, seed=3, temperature=0.0)
    assert (greedy.max_images, greedy.max_new_tokens, greedy.temperature) == (2, 40, 0.0)
    assert greedy.image_geometry == episode_config(cfg, step_cap=1, seed=1).image_geometry


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"shard": True, "replicas": 1}, "needs replicas > 1"),
        ({"shard": True, "replicas": 2, "lora_rank": 8}, "is for full fine-tuning"),
        ({"replicas": 65}, "must be from 1 to 64, or 0 \\(auto\\)"),
    ],
)
def test_sharding_settings_that_cannot_work_are_refused(trainer: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        RunConfig.from_dict({"trainer": trainer})
    assert caught.value.path.startswith("trainer.")


def test_the_learning_rate_follows_the_schedule_update_by_update() -> None:
    """Warm-up, then cosine or linear decay to lr * lr_min_ratio, held after the horizon
    (the trainer sets its optimizer to it before each update)."""
    cosine = RunConfig.from_dict(
        {"trainer": {"lr": 1e-4, "lr_schedule": "cosine", "lr_warmup_updates": 4,
                     "lr_decay_updates": 10, "lr_min_ratio": 0.1}}
    )  # fmt: skip
    lrs = [cosine.trainer.lr_at(n) for n in range(20)]
    assert lrs[:4] == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4])
    assert lrs[4] == pytest.approx(1e-4)  # the decay starts at the peak
    assert lrs[9] == pytest.approx(1e-5 + 9e-5 * (1 + math.cos(math.pi / 2)) / 2)
    assert lrs[14:] == pytest.approx([1e-5] * 6)  # held at the floor
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))
    linear = RunConfig.from_dict(
        {"trainer": {"lr": 1e-4, "lr_schedule": "linear", "lr_decay_updates": 4,
                     "lr_min_ratio": 0.2}}
    )  # fmt: skip
    assert [linear.trainer.lr_at(n) for n in range(6)] == pytest.approx(
        [1e-4, 8e-5, 6e-5, 4e-5, 2e-5, 2e-5]
    )
    constant = RunConfig.from_dict({"trainer": {"lr": 3e-5}})
    assert constant.trainer.lr_at(500) == pytest.approx(3e-5)
    with pytest.raises(ConfigError, match="needs the updates it decays over") as caught:
        RunConfig.from_dict({"trainer": {"lr_schedule": "cosine"}})
    assert caught.value.path == "trainer.lr_decay_updates"
