"""The multi-turn episode runner: reset, then prompt -> policy -> parse -> step -> record,
until `finished` / `call_user` / the environment ending the episode itself
(`Observation.done`, e.g. a MiniWoB++ task after its one click) / the step cap; then the
task's own evaluation.

It receives the environment, the policy client and a recorder as arguments, so tests pass
real small ones (a real browser, the tiny policy's server, the database recorder).

Failures: an unparsable output is recorded on its step (the step is a no-op) and
`max_parse_errors` in a row end the episode as failed; a prompt the server refuses for its
length (`PromptTooLong`) is built again once, its text counted at the counter's upper bound
(`PromptCounter.as_bound`), and the refusal kept in the trajectory's
`details["prompts_refused"]`; `EnvUnavailable` (the env died or timed out) and
`InferenceUnavailable` (no policy answer in time) propagate to the caller, which marks the
trajectory `error` with the reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from core.actions import ActionParseError, CoordSpace, parse_output, to_screen
from core.completion import Completion
from core.imaging import ImageGeometry
from core.prompt_counter import PromptCounter
from core.prompts import PROMPT_TEMPLATES, HistoryTurn, Message, build_messages, prompt_messages
from core.protocol import Action, ActionNotSupported, ActionType, Env, Observation, TaskSpec
from core.steps import StepRecord
from rollout.client import PromptTooLong


class PolicyEndpoint(Protocol):
    def complete(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int = ...,
        temperature: float = ...,
        top_p: float = ...,
        seed: int | None = ...,
    ) -> Completion: ...


class Pacer(Protocol):
    """Paces an episode with others (the synchronous baseline's batch step loop,
    workers.lockstep): `turn(i)` returns when the batch may take turn i; `leave()` says
    this episode takes no more turns."""

    def turn(self, index: int) -> None: ...

    def leave(self) -> None: ...


class Recorder(Protocol):
    def set_instruction(self, instruction: str) -> None: ...

    def record_step(self, record: StepRecord) -> None: ...


@dataclass
class ListRecorder:
    """A Recorder that keeps the current episode's steps in memory (no database): for
    benches and tests that only need the episode's steps back."""

    steps: list[StepRecord] = field(default_factory=list)
    instruction: str = ""

    def set_instruction(self, instruction: str) -> None:
        self.instruction = instruction
        self.steps = []

    def record_step(self, record: StepRecord) -> None:
        self.steps.append(record)


@dataclass(frozen=True)
class EpisodeConfig:
    step_cap: int = 15
    max_images: int = 5
    max_prompt_tokens: int | None = 4096
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    max_parse_errors: int = 3
    coords: CoordSpace = "pixel"
    prompt: str = "dartboard"  # a key of core.prompts.PROMPT_TEMPLATES
    language: str = "English"  # the UI-TARS-1.5 template's Thought language
    seed: int | None = None
    # The policy's processor (`PromptCounter.from_policy_dir`): prompt token budgets, and its
    # image geometry for coordinates when the server does not report its own. No default: a
    # guessed geometry silently maps every click to the wrong pixel.
    prompt_counter: PromptCounter = field(kw_only=True)

    @property
    def image_geometry(self) -> ImageGeometry:
        """The policy's processor's geometry (the counter's: one reading of the checkpoint)."""
        return self.prompt_counter.geometry


class EndReason(StrEnum):
    """How an episode ended, stored as the trajectory's `details["end_reason"]` (the
    dashboard's trajectory list filters on it). One home: readers import it."""

    FINISHED = "finished"  # the policy said so
    CALL_USER = "call_user"
    ENV_DONE = "env_done"  # the environment ended it (`Observation.done`)
    STEP_CAP = "step_cap"
    PARSE_ERRORS = "parse_errors"  # `max_parse_errors` unparsable outputs in a row


class Outcome(StrEnum):
    """How an episode that ran to its end scored: its trajectory's status. One home:
    datamanager's TrajectoryStatus takes these two values from here."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass
class EpisodeResult:
    status: Outcome
    reward: float
    end_reason: EndReason
    steps: int
    details: dict[str, Any] = field(default_factory=dict)
    env_ms: float = 0.0
    model_ms: float = 0.0


def _env_call(fn, *args) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - started) * 1000.0


def play_episode(
    *,
    env: Env,
    policy: PolicyEndpoint,
    recorder: Recorder,
    task: TaskSpec,
    config: EpisodeConfig,
    pacer: Pacer | None = None,
) -> EpisodeResult:
    """Run one episode to its end and evaluate it. See the module docstring for failures.

    With a `pacer`, each policy call waits for `pacer.turn(index)` (so turn 0 waits for
    the whole batch's resets) and the episode leaves the pacer when its last turn is over,
    before its evaluation, or when anything raises."""
    try:
        return _episode_loop(
            env=env, policy=policy, recorder=recorder, task=task, config=config, pacer=pacer
        )
    finally:
        if pacer is not None:
            pacer.leave()


def _episode_loop(
    *,
    env: Env,
    policy: PolicyEndpoint,
    recorder: Recorder,
    task: TaskSpec,
    config: EpisodeConfig,
    pacer: Pacer | None,
) -> EpisodeResult:
    """Long because it is the episode loop read top to bottom: observe, prompt, call,
    parse, act, record, end."""
    obs, reset_ms = _env_call(env.reset, task)
    instruction = obs.instruction or task.instruction
    recorder.set_instruction(instruction)
    history: list[HistoryTurn] = []
    screenshots: list[bytes] = [obs.screenshot_png]
    env_total, model_total = reset_ms, 0.0
    parse_errors_in_a_row = 0
    end_reason = EndReason.STEP_CAP
    ended_by: ActionType | None = None  # finished / call_user, for the env's verdict
    index = 0
    prompts_refused: list[dict[str, Any]] = []
    for index in range(config.step_cap):
        if pacer is not None:
            pacer.turn(index)
        prompt, completion = _prompt_and_reply(
            policy=policy,
            config=config,
            instruction=instruction,
            history=history,
            screenshots=screenshots,
            index=index,
            refused=prompts_refused,
        )
        model_total += completion.latency_ms
        action, thought, parse_error = _parse(completion, obs, config)
        env_ms = None
        next_obs = obs
        if action is not None and not action.ends_episode:
            try:
                next_obs, env_ms = _env_call(env.step, action)
                env_total += env_ms
            except ActionNotSupported as exc:
                # The backend cannot do this action: a policy mistake, recorded like a
                # parse error (the step is a no-op), not an environment failure.
                parse_error = f"action not supported: {exc}"
                action = None
        recorder.record_step(
            StepRecord(
                index=index,
                screenshot_png=obs.screenshot_png,
                width=obs.width,
                height=obs.height,
                raw_output=completion.text,
                thought=thought,
                action=action.to_json() if action is not None else None,
                parse_error=parse_error,
                prompt_tokens=completion.prompt_tokens,
                response_tokens=completion.response_tokens,
                rollout_logprobs=list(completion.token_logprobs),
                response_token_ids=list(completion.token_ids),
                mean_entropy=completion.mean_entropy,
                policy_version=completion.policy_version,
                env_ms=env_ms,
                model_ms=completion.latency_ms,
                prompt=prompt,
                prompt_token_ids=list(completion.prompt_token_ids),
            )
        )
        history.append(HistoryTurn.from_output(completion.text))
        if parse_error:
            parse_errors_in_a_row += 1
            if parse_errors_in_a_row >= config.max_parse_errors:
                end_reason = EndReason.PARSE_ERRORS
                break
        else:
            parse_errors_in_a_row = 0
        if action is not None and action.type == ActionType.FINISHED:
            end_reason, ended_by = EndReason.FINISHED, action.type
            break
        if action is not None and action.type == ActionType.CALL_USER:
            end_reason, ended_by = EndReason.CALL_USER, action.type
            break
        if next_obs.done:
            # Asking the policy again would only add steps that cannot change the outcome
            # (and, in training, would share the trajectory's reward with them).
            end_reason = EndReason.ENV_DONE
            break
        obs = next_obs
        screenshots.append(obs.screenshot_png)
    if pacer is not None:
        pacer.leave()  # the rest of the batch need not wait for this evaluation
    evaluation, eval_ms = _env_call(lambda: env.evaluate(ended_by=ended_by))
    env_total += eval_ms
    # reset_ms: the per-host health map's reset time (a host whose resets slow down is
    # overloaded before its episodes start failing).
    details = {**evaluation.details, "end_reason": end_reason, "reset_ms": round(reset_ms, 1)}
    if prompts_refused:
        details["prompts_refused"] = prompts_refused
    return EpisodeResult(
        status=Outcome.SUCCEEDED if evaluation.success else Outcome.FAILED,
        reward=evaluation.reward,
        end_reason=end_reason,
        steps=index + 1,
        details=details,
        env_ms=env_total,
        model_ms=model_total,
    )


def _prompt_and_reply(
    *,
    policy: PolicyEndpoint,
    config: EpisodeConfig,
    instruction: str,
    history: list[HistoryTurn],
    screenshots: list[bytes],
    index: int,
    refused: list[dict[str, Any]],
) -> tuple[list[Message], Completion]:
    """Turn `index`'s prompt as the step stores it (its images name their steps: the trainer
    reads the stored one back, never rebuilds it) and the policy's reply. A prompt refused
    for its length is appended to `refused` and built once more with its text counted at the
    counter's upper bound; then the reply or the error stands."""

    def prompt_for(counter: PromptCounter) -> list[Message]:
        shown = screenshots[-config.max_images :]
        return build_messages(
            instruction=instruction,
            history=history,
            screenshots=shown,
            max_images=config.max_images,
            template=PROMPT_TEMPLATES[config.prompt],
            language=config.language,
            max_prompt_tokens=config.max_prompt_tokens,
            counter=counter,
            step_refs=range(len(screenshots) - len(shown), len(screenshots)),
        )

    def reply_to(prompt: list[Message]) -> Completion:
        return policy.complete(
            prompt_messages(prompt, screenshots),
            max_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=None if config.seed is None else config.seed * 1000 + index,
        )

    prompt = prompt_for(config.prompt_counter)
    try:
        return prompt, reply_to(prompt)
    except PromptTooLong as refusal:
        # The server counted more than the counter did (a tokenizer of another version, say).
        refused.append({"step": index, "refusal": str(refusal)})
        prompt = prompt_for(config.prompt_counter.as_bound())
        return prompt, reply_to(prompt)


def _parse(
    completion: Completion, obs: Observation, config: EpisodeConfig
) -> tuple[Action | None, str, str]:
    """(screen-space action or None, thought, parse error message or '').

    The model image size comes from the serving processor's geometry when the server
    reports it (so a policy with another processor maps correctly), else from the config."""
    try:
        parsed = parse_output(completion.text, coords=config.coords)
    except ActionParseError as exc:
        return None, "", str(exc)
    geometry = completion.image_geometry or config.image_geometry
    model_size = geometry.model_size(width=obs.width, height=obs.height)
    action = to_screen(
        parsed.action,
        screen_size=(obs.width, obs.height),
        model_size=model_size,
        coords=config.coords,
    )
    return action, parsed.thought, ""
