"""The valid values of each update knob, in one place, each with its one message.

`UpdateConfig` (training/update.py) checks its fields here, and the run config
(datamanager/config.py) checks the trainer and curation knobs that become them here too, so
a bad value is refused with the same words wherever it is set; the caller puts the setting's
name in front ("UpdateConfig.clip_low must be in (0, 1) ...", "trainer.clip_low: must be in
(0, 1) ..."). No torch here: the web process validates run forms with it.

    .venv/bin/python -c "from training.ranges import range_error as e; print(e('is_cap', 0))"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

LossType = Literal["ppo", "gspo"]  # "ppo": token-level clipped ratio; "gspo": sequence-level
# "trajectory": every trajectory weighs the same; "token": DART's mean over all tokens.
Aggregation = Literal["trajectory", "token"]


@dataclass(frozen=True)
class Range:
    ok: Callable[[Any], bool]
    rule: str  # what a valid value is; "{name}" stands for the setting's name


def _one_of(choices: Any) -> Range:
    names = get_args(choices)
    return Range(lambda v: v in names, f"must be one of {', '.join(names)}")


_LOWER_CLIP = Range(
    lambda v: 0 < v < 1, "must be in (0, 1) (the ratio's lower bound is 1 - {name})"
)
_UPPER_CLIP = Range(lambda v: v > 0, "must be > 0 (the ratio's upper bound is 1 + {name})")
_POSITIVE = Range(lambda v: v > 0, "must be > 0")
_COUNT = Range(lambda v: v >= 1, "must be >= 1")

# UpdateConfig's fields, in the order it checks them.
UPDATE_RANGES: dict[str, Range] = {
    "loss_type": _one_of(LossType),
    "aggregation": _one_of(Aggregation),
    "clip_low": _LOWER_CLIP,
    "gspo_clip_low": _LOWER_CLIP,
    "clip_high": _UPPER_CLIP,
    "gspo_clip_high": _UPPER_CLIP,
    "kl_coef": Range(lambda v: v >= 0, "must be >= 0 (0 disables the KL)"),
    "bc_weight": Range(lambda v: v >= 0, "must be >= 0 (0 disables behaviour cloning)"),
    "entropy_top_q": Range(lambda v: 0 < v <= 1, "must be in (0, 1] (1.0 keeps every step)"),
    "is_cap": Range(lambda v: v > 0, "must be > 0 (DART uses 1.0)"),
    "adv_eps": _POSITIVE,
    "micro_batch": _COUNT,
    "mini_batches": _COUNT,
    "ppo_epochs": _COUNT,
    "max_grad_norm": _POSITIVE,
    "lr": _POSITIVE,
}


def range_error(knob: str, value: Any, *, name: str = "") -> str | None:
    """Why `value` is not valid for the update knob `knob`, or None when it is. `name` is the
    setting's name where it is set under another (the run config's `grad_clip` for
    `max_grad_norm`)."""
    valid = UPDATE_RANGES[knob]
    if valid.ok(value):
        return None
    return f"{valid.rule.format(name=name or knob)}, got {value!r}"
