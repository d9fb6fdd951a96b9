"""Plain data that crosses the database -> trainer boundary (and the metrics that go back).

The trainer never sees Django rows: a thin task module turns `Step` rows into `TrainSample`s,
calls `training.update.policy_update`, and writes the returned `UpdateMetrics` back (the
scalar part to `TrainUpdate.metrics` via `UpdateMetrics.as_json()`, the per-step dicts to
`Step.entropy_kept` / `Step.advantage` / `Step.is_weight`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.protocol import Action


@dataclass(frozen=True)
class TrainSample:
    """One step-level training sample: one assistant turn of one trajectory.

    All steps of a trajectory share its reward; the group for the advantage is the task.
    """

    step_id: int  # Step primary key; the key of every per-step metric.
    trajectory_id: int  # Trajectory the step belongs to (advantages are per trajectory).
    group_id: int  # Advantage group (a TaskGroup: online rollouts of one task + pool joins).
    messages: list[dict[str, Any]]  # OpenAI-style prompt messages the policy saw at this step.
    response_text: str  # What the policy answered ("Thought: ...\nAction: ...").
    reward: float  # The trajectory's reward, shared by all its steps.
    rollout_logprobs: list[float]  # Per response token, from the inference server ([] if unknown).
    mean_entropy: float  # Mean token entropy of the response at rollout time.
    policy_version: int  # Policy version that produced the response.
    is_demo: bool = False  # Experience-pool (behaviour-cloning) sample, not an online rollout.
    response_token_ids: list[int] | None = None  # The exact sampled tokens (else re-tokenized).
    # The prompt's token ids as the server reported them, image pads expanded (else the
    # messages are encoded: a demonstration, a step stored before ids were kept).
    prompt_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(
                f"TrainSample step {self.step_id}: reward must be a finite number, got "
                f"{self.reward!r} (a trajectory without a reward is not ready for training)"
            )
        if not math.isfinite(self.mean_entropy):
            raise ValueError(
                f"TrainSample step {self.step_id}: mean_entropy must be finite, got "
                f"{self.mean_entropy!r} (record the rollout entropy or use 0.0 for demos)"
            )


def samples_write(path: Path, samples: Sequence[TrainSample]) -> Path:
    """Write samples as JSON lines (screenshots stay the data URLs they are), atomically:
    how a trainer leader hands an update's batch to its replicas on the same host without
    pickling it through a collective (`training.trainer.PolicyTrainer.update`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for sample in samples:
            f.write(json.dumps(asdict(sample)) + "\n")
    os.replace(tmp, path)
    return path


def samples_read(path: Path) -> list[TrainSample]:
    """The samples `samples_write` wrote, in order."""
    with path.open() as f:
        return [TrainSample(**json.loads(line)) for line in f if line.strip()]


@dataclass
class UpdateMetrics:
    """What one `policy_update` did: dashboard scalars plus per-step decisions.

    Loss terms are means over the update's optimizer steps; `clip_fraction` and the IS weight
    statistics are over trained tokens (sequences for GSPO's clip fraction).
    """

    loss: float = 0.0  # Total loss: pg + kl_coef * kl + bc_weight * bc.
    pg_loss: float = 0.0  # Policy-gradient (PPO or GSPO clipped surrogate) term.
    kl: float = 0.0  # k3 KL estimate to the reference policy (0 when kl_coef == 0).
    bc_loss: float = 0.0  # Behaviour-cloning NLL on demo tokens (0 without demos/bc_weight).
    mean_entropy: float = 0.0  # Mean token entropy of pi_old over the trained tokens.
    clip_fraction: float = 0.0  # Share of trained tokens (GSPO: sequences) whose ratio was clipped.
    is_weight_mean: float = 1.0  # Truncated IS weight over trained tokens: mean.
    is_weight_min: float = 1.0  # ... minimum.
    is_weight_max: float = 1.0  # ... maximum.
    is_misaligned_steps: int = 0  # Steps whose rollout logprob count != response tokens (w=1).
    # |log pi_old - log pi_rollout| per token over the steps of the version being trained
    # (fresh steps: the same weights on both sides): mean, 99th percentile, tokens measured.
    logprob_gap_mean: float = 0.0
    logprob_gap_p99: float = 0.0
    logprob_gap_tokens: int = 0
    grad_norm: float = 0.0  # Gradient norm before clipping (last optimizer step).
    lr: float = 0.0  # Learning rate of the optimizer steps (0: none taken).
    optimizer_steps: int = 0  # Optimizer steps taken (0: nothing to train).
    n_samples: int = 0  # Samples handed to the update.
    n_trained_steps: int = 0  # Steps that received policy-gradient signal.
    n_demo_steps: int = 0  # Experience-pool steps in the update.
    n_tokens: int = 0  # Response tokens that received policy-gradient signal.
    n_groups: int = 0  # Task groups in the update.
    skipped_groups: int = 0  # Groups with zero reward variance (or a single trajectory).
    kept_step_fraction: float = 0.0  # n_trained_steps / n_samples.
    advantage_mean: float = 0.0  # Over trained steps.
    advantage_std: float = 0.0  # Over trained steps (population std).
    advantage_min: float = 0.0
    advantage_max: float = 0.0
    duration_s: float = 0.0  # Wall time of the update.
    # The forward passes that ran over each micro-batch: "old+ref+grad", or "ref+grad" when
    # the gradient pass's own log-probs are pi_old's (one epoch, one optimizer step).
    passes: str = ""
    old_pass_s: float = 0.0  # Seconds in the separate pi_old pass (0 when it was skipped).
    ref_pass_s: float = 0.0  # Seconds in the reference model's passes.
    grad_pass_s: float = 0.0  # Seconds in the gradient passes (forward and backward).
    optimizer_s: float = 0.0  # Seconds in gradient clipping and the optimizer steps.
    encode_s: float = 0.0  # Seconds encoding prompts (the image processor), inside the passes.
    encode_reused: int = 0  # Prompt encodings reused from an earlier pass of this update.
    image_features_reused: int = 0  # Screenshots a frozen vision tower did not encode again.
    samples_per_s: float = 0.0  # Forwarded samples / duration_s.
    staleness: dict[int, int] = field(default_factory=dict)  # versions behind -> online steps.
    step_kept: dict[int, bool] = field(default_factory=dict)  # step_id -> got pg signal.
    step_entropy_kept: dict[int, bool] = field(default_factory=dict)  # step_id -> entropy filter.
    step_advantage: dict[int, float] = field(default_factory=dict)  # step_id -> advantage.
    step_is_weight: dict[int, float] = field(default_factory=dict)  # step_id -> mean IS weight.

    def as_json(self) -> dict[str, Any]:
        """Scalars and the staleness histogram, JSON-ready (for `TrainUpdate.metrics`)."""
        data = asdict(self)
        for key in ("step_kept", "step_entropy_kept", "step_advantage", "step_is_weight"):
            data.pop(key)
        data["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        return data


Box = tuple[int, int, int, int]  # left, top, right, bottom (right/bottom exclusive)


@dataclass(frozen=True)
class GroundingSample:
    """One screen and where to click: `box` holds the target widget, (x, y) is inside it.

    Coordinates are screen pixels of the `width` x `height` PNG. `source` says where the
    sample came from ("synthetic/<layout>" or "miniwob/<task>").
    """

    png: bytes
    width: int
    height: int
    instruction: str
    x: int
    y: int
    box: Box
    source: str


@dataclass(frozen=True)
class DesktopStep:
    """One step of a multi-step desktop episode: the screen, the actions taken before it,
    and the action to take now (any type, screen pixels of the `width` x `height` PNG).

    `boxes` holds one box per point of `action` (a drag: the thing dragged, then where it
    goes); a correct point lies inside its box. `source` is "desktop/<scene>".
    """

    png: bytes
    width: int
    height: int
    instruction: str
    history: tuple[Action, ...]  # the earlier steps' actions, in order
    action: Action
    boxes: tuple[Box, ...]
    source: str

    @property
    def box(self) -> Box | None:
        """The box of the response's last point (the attention supervision's target)."""
        return self.boxes[-1] if self.boxes else None
