"""Reading stored steps back: `trajectory_turns` is the one reader of what a trajectory's
policy was given and what it is trained to answer, for the trainer (`services.batches`) and
the SFT export (`services.datasets`) alike, so an exported chat is the prompt the policy saw.

A step a policy of this platform answered is read back as stored: its prompt's messages
(`Step.prompt`, images put back from the steps' screenshots) and the prompt's token ids as
the server reported them (`Step.prompt_token_ids`). Two kinds of step have no stored prompt
and get the one this run's rollout would build: a demonstration recorded elsewhere (no policy
here was asked) and a step stored before prompts were kept. A step stored before token ids
were kept has an empty `prompt_token_ids`: the trainer encodes its stored messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.core.files.storage import default_storage

from core.actions import CoordSpace, format_screen_action
from core.imaging import ImageGeometry
from core.prompts import (
    PROMPT_TEMPLATES,
    HistoryTurn,
    PromptTemplate,
    build_messages,
    prompt_messages,
    prompt_steps_shown,
)
from core.protocol import Action
from core.steps import StepRecord, unpack_token_ids
from datamanager.config import RunConfig
from datamanager.models import Step, Trajectory
from datamanager.policies import policy_prompt_counter

REPLY_FROM_ACTION = "reply_from_action"
"""A trajectory's `details` key: its steps' replies are written from their actions for the
policy that trains on them (demonstrations recorded in another format: OSWorld's, AgentNet's),
not read from `raw_output`."""


@dataclass(frozen=True)
class Turn:
    """One step as training and export read it."""

    step: Step
    screenshot_png: bytes  # b"": the step has no screenshot
    # The OpenAI messages the policy was given, images inline; None when an image it shows
    # is gone (a step copied without its screenshot).
    messages: list[dict[str, Any]] | None
    prompt_token_ids: list[int]  # as the server reported them; []: encode `messages`
    reply: str  # what the policy is trained to answer


def step_reply(
    traj: Trajectory,
    step: Step,
    *,
    geometry: ImageGeometry,
    template: PromptTemplate,
    coords: CoordSpace,
) -> str:
    """What the policy is trained to answer on `step`: the reply it wrote (`raw_output`), or,
    for a demonstration recorded in another format, its action in this policy's coordinates
    (and its thought, where the prompt asks for one)."""
    if not (traj.details or {}).get(REPLY_FROM_ACTION) or not step.action:
        return step.raw_output
    return format_screen_action(
        Action.from_json(step.action),
        screen_size=(step.screen_width, step.screen_height),
        geometry=geometry,
        coords=coords,
        thought=step.thought if template.thoughts else "",
    )


def screenshot_read(step: Step) -> bytes:
    """The step's screenshot (b"" when it has none); FileNotFoundError when its file is gone
    from storage."""
    if not step.screenshot.name:
        return b""
    with default_storage.open(step.screenshot.name, "rb") as fh:
        return fh.read()


def trajectory_turns(
    traj: Trajectory,
    steps: Sequence[Step],
    *,
    cfg: RunConfig,
    keep: set[int] | None = None,
) -> list[Turn]:
    """The turns of `steps` (a trajectory's, in index order), only those in `keep` (step
    ids; None: all). `cfg`: the run whose policy reads them (its prompt template, prompt
    counter, image geometry and coordinates build the prompts of steps that stored none)."""
    counter = policy_prompt_counter(cfg.policy)
    geometry = counter.geometry
    template = PROMPT_TEMPLATES[cfg.rollout.prompt]
    shots: list[bytes] = []
    history: list[HistoryTurn] = []
    out: list[Turn] = []
    for step in steps:
        shots.append(screenshot_read(step))
        reply = step_reply(
            traj, step, geometry=geometry, template=template, coords=cfg.rollout.coords
        )
        if keep is None or step.pk in keep:
            messages: list[dict[str, Any]] | None = None
            if step.prompt:
                if all(shots[i] for i in prompt_steps_shown(step.prompt)):
                    messages = prompt_messages(step.prompt, shots)
            elif shots[-1]:
                shown = [s for s in shots[-cfg.rollout.max_images :] if s]
                messages = build_messages(
                    instruction=traj.instruction,
                    history=history,
                    screenshots=shown,
                    max_images=cfg.rollout.max_images,
                    template=template,
                    language=cfg.rollout.language,
                    max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                    counter=counter,
                )
            out.append(
                Turn(
                    step=step,
                    screenshot_png=shots[-1],
                    messages=messages,
                    prompt_token_ids=unpack_token_ids(step.prompt_token_ids) if step.prompt else [],
                    reply=reply,
                )
            )
        history.append(HistoryTurn.from_output(reply))
    return out


def step_record(step: Step, *, screenshot_png: bytes) -> StepRecord:
    """What a stored step was, as a record (a trimmed copy is stored from it)."""
    return StepRecord(
        index=step.index,
        screenshot_png=screenshot_png,
        width=step.screen_width,
        height=step.screen_height,
        raw_output=step.raw_output,
        thought=step.thought,
        action=step.action,
        parse_error=step.parse_error,
        prompt_tokens=step.prompt_tokens,
        response_tokens=step.response_tokens,
        rollout_logprobs=step.rollout_logprobs,
        response_token_ids=step.response_token_ids,
        mean_entropy=step.mean_entropy,
        policy_version=step.policy_version,
        env_ms=step.env_ms,
        model_ms=step.model_ms,
        prompt=step.prompt,
        prompt_token_ids=unpack_token_ids(step.prompt_token_ids),
    )
