"""The update's knobs, in one place: their defaults (`UpdateConfig`) and their valid values,
each with its one message.

`UpdateConfig` checks its fields here; the run config (datamanager/config.py) takes the
defaults of its trainer and curation knobs that become them from `UPDATE_DEFAULTS`, and
checks them here too, so a bad value is refused with the same words wherever it is set;
the caller puts the setting's name in front ("UpdateConfig.clip_low must be in (0, 1) ...", "trainer.clip_low: must be in
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


@dataclass
class UpdateConfig:
    """Knobs of one policy update (the trainer maps the run's TrainerConfig/CurationConfig here).
    Their valid values are training.ranges' (the run config checks its knobs there too)."""

    loss_type: LossType = "ppo"  # "ppo": token-level clipped ratio; "gspo": sequence-level ratio.
    # "trajectory": every trajectory weighs the same (its steps averaged, each step a token
    # mean); "token": DART's mean over all tokens, so long (mostly failed) episodes dominate.
    aggregation: Aggregation = "trajectory"
    clip_low: float = 0.2  # PPO: ratio clipped below at 1 - clip_low.
    clip_high: float = 0.28  # PPO: ratio clipped above at 1 + clip_high (clip-higher).
    gspo_clip_low: float = 3e-4  # GSPO: sequence ratio clipped below at 1 - gspo_clip_low.
    gspo_clip_high: float = 4e-4  # GSPO: sequence ratio clipped above at 1 + gspo_clip_high.
    kl_coef: float = 0.1  # Weight of the k3 KL to the reference policy (0: no ref model needed).
    bc_weight: float = 0.0  # Weight of behaviour cloning on experience-pool (demo) steps.
    entropy_top_q: float = 0.8  # Train on this top fraction of steps by entropy (1.0: all).
    # Re-centre the kept steps' advantages per group after the entropy filter (see
    # losses.recenter_kept_advantages); False trains DART's uncentred advantages.
    entropy_recenter: bool = True
    truncated_is: bool = True  # Multiply the loss by min(pi_old / pi_rollout, is_cap).
    is_cap: float = 1.0  # Truncation C of the importance weight.
    adv_eps: float = 1e-6  # Added to the group reward std before dividing.
    micro_batch: int = 8  # Samples per forward/backward (gradient accumulation unit).
    mini_batches: int = 1  # Optimizer steps per epoch (the batch split into this many parts).
    ppo_epochs: int = 1  # Passes over the batch; >1 makes pi_theta drift from pi_old.
    max_grad_norm: float = 1.0  # Gradient norm clipping before each optimizer step.
    lr: float | None = None  # This update's learning rate (a schedule's); None: the optimizer's.

    def __post_init__(self) -> None:
        for knob in UPDATE_RANGES:
            value = getattr(self, knob)
            if knob == "lr" and value is None:
                continue  # the optimizer's own
            message = range_error(knob, value)
            if message:
                raise ValueError(f"UpdateConfig.{knob} {message}")

    @property
    def pg_clip(self) -> tuple[float, float]:
        """(clip_low, clip_high) of the configured loss type."""
        if self.loss_type == "gspo":
            return self.gspo_clip_low, self.gspo_clip_high
        return self.clip_low, self.clip_high


UPDATE_DEFAULTS = UpdateConfig()  # the run config's defaults for the knobs above
