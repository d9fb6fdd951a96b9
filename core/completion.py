"""One assistant turn as a policy server answered it: the contract between whatever serves
the policy (an inference server, vLLM, the scripted oracle) and the episode runner."""

from __future__ import annotations

import time
from dataclasses import dataclass

from core.imaging import ImageGeometry


@dataclass(frozen=True)
class Completion:
    """One assistant turn as the rollout records it.

    token_logprobs[i] is log p(token_ids[i]) under the serving model at temperature 1;
    token_ids include the stop token when finish_reason == "stop". token_ids is empty
    when the server returned neither `token_id` fields nor "token_id:N" token strings.
    """

    text: str
    token_ids: list[int]
    token_logprobs: list[float]
    mean_entropy: float
    policy_version: int | None
    prompt_tokens: int
    response_tokens: int
    finish_reason: str
    latency_ms: float
    served_by: str
    image_geometry: ImageGeometry | None = None  # the server's processor, when it reports it
    # The prompt as the server tokenized it (image pads expanded), when it reports it
    # (`return_token_ids`): what the trainer trains on, never re-tokenized.
    prompt_token_ids: tuple[int, ...] = ()

    @classmethod
    def scripted(cls, text: str, *, started: float, served_by: str) -> Completion:
        """A text-only turn (scripted policies, in-process benches): no tokens or log-probs.
        `started` is the time.perf_counter() at which the request began."""
        return cls(
            text=text,
            token_ids=[],
            token_logprobs=[],
            mean_entropy=0.0,
            policy_version=None,
            prompt_tokens=0,
            response_tokens=0,
            finish_reason="stop",
            latency_ms=(time.perf_counter() - started) * 1000.0,
            served_by=served_by,
        )
