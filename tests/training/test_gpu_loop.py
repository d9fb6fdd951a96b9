"""bench/gpu_loop.py's CPU mode: the whole loop (a served group of episodes with UI-TARS-1.5's
prompt and 1920x1080 screens, a LoRA update with gradient checkpointing, the adapter synced
into the server, a resumed trainer) on the tiny policy, as a GPU host runs it at 7B."""

from __future__ import annotations

import pytest

from bench import gpu_loop

pytestmark = [pytest.mark.slow, pytest.mark.live]


def test_the_loop_serves_trains_syncs_and_resumes_on_the_cpu():
    rows, figures = gpu_loop.run(cpu=True, steps=2, max_new_tokens=8)
    table = dict(rows)
    assert figures["steps"] == gpu_loop.EPISODES * 2
    assert "replies as version 1" in table["adapter synced into the server"]
    # fp32 on both sides, the same weights: only kernels and batching separate them.
    assert figures["gap_max"] < 1e-3
    assert figures["resumed_version"] == 1 and figures["resume_max_diff"] < 1e-5
