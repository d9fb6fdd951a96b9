"""How an optimizer step's samples are split into micro-batches (one forward and backward
each): by a token budget and a sample cap, from the samples' lengths alone, so a memory plan
can choose the two numbers and nothing else changes. `training.update` and
`training.old_logprobs` form every micro-batch here.

    .venv/bin/python -c "from training.micro_batches import micro_batches; \
        print(micro_batches([900, 300, 2000, 400], max_tokens=1200, max_samples=8))"
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(lengths: Sequence[int], *, max_tokens: int, max_samples: int) -> list[list[int]]:
    """Split samples 0..N-1, in order, into consecutive micro-batches of at most
    `max_samples` samples whose lengths sum to at most `max_tokens`.

    Greedy: a micro-batch takes the next sample while both limits hold. A sample longer
    than `max_tokens` gets a micro-batch of its own: it still trains, in the smallest
    forward there is. The order is kept because consecutive steps of a trajectory show the
    same screenshots, which the encoder reuses (`core.encoding.ImageCache`), and a
    prefetch encodes in this order (`training.prompt_cache`).

    Args:
        lengths: [N] tokens of each sample (prompt and response, image tokens included).
        max_tokens: the token budget of one micro-batch (>= 1).
        max_samples: the most samples in one micro-batch (>= 1).
    Returns:
        Positions into `lengths`, one list per micro-batch; every position once, in order.
    """
    if max_tokens < 1 or max_samples < 1:
        raise ValueError(
            f"micro_batches needs max_tokens >= 1 and max_samples >= 1, got {max_tokens} "
            f"and {max_samples}"
        )
    out: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, length in enumerate(lengths):
        if current and (len(current) == max_samples or tokens + length > max_tokens):
            out.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += length
    if current:
        out.append(current)
    return out
