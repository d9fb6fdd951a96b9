"""Live environments shared by the envmanager tests: one chromium and one X desktop per session.

Fault-injection tests build their own envs so a killed browser never leaks into others.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from core.protocol import Action, Evaluation, Observation, TaskSpec
from envmanager.desktop_env import DesktopEnv
from envmanager.miniwob_env import MiniWoBEnv
from envmanager.threaded import ThreadedEnv
from tests.helpers import needs


@pytest.fixture(scope="session")
@needs("browser")
def miniwob_env() -> Iterator[ThreadedEnv]:
    """On a thread of its own, as a slot runs it (envmanager/threaded.py): Playwright's sync
    API marks the thread that drives it as running an asyncio loop, and this env lives for
    the whole session, so on the test thread every later database test would be refused
    with SynchronousOnlyOperation. `.backend` is the MiniWoBEnv."""
    env = ThreadedEnv(MiniWoBEnv, timeout_s=60.0)
    yield env
    env.close()


@pytest.fixture(scope="session")
@needs("desktop")
def desktop_env() -> Iterator[DesktopEnv]:
    env = DesktopEnv(evaluate_wait_s=0.5)
    yield env
    env.close()


@pytest.fixture(scope="session")
def oracle_episode():
    """run_oracle_episode(env, spec) -> (Evaluation, steps), as a fixture for the test modules."""
    return run_oracle_episode


def run_oracle_episode(env, spec: TaskSpec, *, max_steps: int = 20) -> tuple[Evaluation, int]:
    """Reset, follow the oracle until it stops, evaluate. Returns (evaluation, steps)."""
    from envmanager.oracles import oracle_action

    obs: Observation = env.reset(spec)
    steps = 0
    while steps < max_steps:
        action: Action | None = oracle_action(
            env_kind=spec.env_kind, task_name=spec.name, observation=obs
        )
        if action is None:
            break
        obs = env.step(action)
        steps += 1
    return env.evaluate(), steps


@pytest.fixture(scope="session")
def desktop_policy():
    """policies/tiny-desktop decoding greedily in this process (bench/desktop.py's endpoint)."""
    import torch

    from bench.desktop import POLICIES
    from bench.grounding import ModelEndpoint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ModelEndpoint(POLICIES["desktop"], max_new_tokens=48)
    torch.set_num_threads(threads)
