"""A Step row from what a step was: the one place its fields are written (rollouts, imported
and pre-collected demonstrations, trimmed copies), and the text made storable."""

from __future__ import annotations

from typing import Any

from django.core.files.base import ContentFile

from datamanager.models import Step
from rollout.episode import StepRecord


def storable(value: Any) -> Any:
    """`value` with every NUL character of its strings (nested in lists and dicts too) made
    U+FFFD. PostgreSQL's text and jsonb refuse NUL ("text fields cannot contain NUL (0x00)
    bytes"), and an untrained policy's byte-level tokens decode to it: without this, a step
    the model wrote NUL in would end its episode as an environment error on PostgreSQL only.
    Training re-uses the token ids, not the text, so nothing it learns from changes."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v) for v in value]
    return value


def step_row(
    *, trajectory_id: int, record: StepRecord, screenshot_name: str | None, replace: bool = False
) -> Step:
    """The one place a Step row is made from what a step was: the unsaved row of `record`
    (text made storable) with its screenshot stored as `screenshot_name` in media storage
    (None: no screenshot; `replace`: a file already under that name is deleted first).
    Rollouts, imported and pre-collected demonstrations and trimmed copies all come through
    here."""
    step = Step(
        trajectory_id=trajectory_id,
        index=record.index,
        screen_width=record.width,
        screen_height=record.height,
        raw_output=storable(record.raw_output),
        thought=storable(record.thought),
        action=storable(record.action),
        parse_error=storable(record.parse_error),
        prompt_tokens=record.prompt_tokens,
        prompt=storable(record.prompt),
        response_tokens=record.response_tokens,
        rollout_logprobs=record.rollout_logprobs,
        response_token_ids=record.response_token_ids or [],
        mean_entropy=record.mean_entropy,
        policy_version=record.policy_version,
        env_ms=record.env_ms,
        model_ms=record.model_ms,
    )
    if screenshot_name is None:
        return step
    if replace:  # the file a failed try stored under this name, with no row to it
        stored = step.screenshot.field.generate_filename(step, screenshot_name)
        if step.screenshot.storage.exists(stored):
            step.screenshot.storage.delete(stored)
    step.screenshot.save(screenshot_name, ContentFile(record.screenshot_png), save=False)
    return step


def step_as_record(step: Step, screenshot_png: bytes) -> StepRecord:
    """What a stored step was, as a record (a trimmed copy is made from it)."""
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
    )
