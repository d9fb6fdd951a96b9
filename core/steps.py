"""The step contract: one step of a trajectory as every layer hands it on, from the episode
runner (`rollout.episode`) or a demonstration's import to the store
(`datamanager.services.steps.steps_store`), and back out to the trainer and the exports
(`datamanager.selectors.steps.trajectory_turns`).

A step carries what the policy was given and what it gave back, exactly: the prompt's messages
(its images as references to the trajectory's steps, `core.prompts.prompt_messages`), the
prompt's token ids as the serving process reported them (image pads expanded), the sampled
token ids and their log-probs, and the policy version. The trainer trains on these ids and
the exports write these messages; neither rebuilds them.
"""

from __future__ import annotations

import array
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    """One step: the screen the policy saw, the prompt it was given, what it said, what was
    done. A demonstration recorded elsewhere (`StepRecord.demonstration`) has no prompt, no
    tokens and no version: no policy of this platform was asked."""

    index: int
    screenshot_png: bytes  # b"": the screenshot is gone (a copy of a step whose file was lost)
    width: int
    height: int
    raw_output: str
    thought: str
    action: dict[str, Any] | None  # Action.to_json(), screen pixels; None: nothing was done
    parse_error: str
    prompt_tokens: int
    response_tokens: int
    rollout_logprobs: list[float]
    response_token_ids: list[int]
    mean_entropy: float | None
    policy_version: int | None
    env_ms: float | None
    model_ms: float | None
    # The messages the policy was given, images as references to the trajectory's steps;
    # empty where no policy was asked.
    prompt: list[dict[str, Any]] = field(default_factory=list)
    # The prompt's token ids as the server tokenized it (image pads expanded); empty where
    # the server reported none (a scripted policy) or no policy was asked.
    prompt_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def demonstration(
        cls,
        *,
        index: int,
        screenshot_png: bytes,
        width: int,
        height: int,
        raw_output: str,
        thought: str,
        action: dict[str, Any] | None,
    ) -> StepRecord:
        """A step recorded elsewhere (an oracle, an imported demonstration): its screen and
        reply, nothing a policy server reported."""
        return cls(
            index=index,
            screenshot_png=screenshot_png,
            width=width,
            height=height,
            raw_output=raw_output,
            thought=thought,
            action=action,
            parse_error="",
            prompt_tokens=0,
            response_tokens=0,
            rollout_logprobs=[],
            response_token_ids=[],
            mean_entropy=None,
            policy_version=None,
            env_ms=None,
            model_ms=None,
        )


def pack_token_ids(ids: list[int]) -> bytes:
    """Token ids as stored: little-endian uint32, zlib-compressed. A UI-TARS prompt of five
    screenshots is ~14,000 ids, mostly runs of image pads: a few kilobytes packed, against
    ~90 kB as JSON, and packing costs a fraction of encoding JSON on the step's hot path."""
    if not ids:
        return b""
    packed = array.array("I", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return zlib.compress(packed.tobytes(), 1)


def unpack_token_ids(data: bytes | memoryview | None) -> list[int]:
    """The ids `pack_token_ids` packed ([] for none)."""
    if not data:
        return []
    packed = array.array("I")
    packed.frombytes(zlib.decompress(bytes(data)))
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()
