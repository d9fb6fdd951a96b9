"""Run an environment backend on a thread of its own, with a time limit on every call.

Two reasons: Playwright's sync API keeps an asyncio loop on the thread that drives it, and
Django refuses database calls on such a thread (SynchronousOnlyOperation), so the episode
loop and the browser must not share one; and a hung browser or X server must become an
`EnvUnavailable` after `timeout_s`, never a worker stuck forever.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any, TypeVar

from core.protocol import (
    Action,
    ActionType,
    Env,
    EnvUnavailable,
    Evaluation,
    Observation,
    TaskSpec,
)

T = TypeVar("T")


class ThreadedEnv:
    """An `Env` whose backend lives on one dedicated thread (created there, used there)."""

    def __init__(self, factory: Callable[[], Env], *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="env")
        self._broken = False
        self._env: Env = self._call("start", factory, timeout=max(timeout_s, 60.0))
        self.kind = self._env.kind

    @property
    def backend(self) -> Env:
        return self._env

    def _call(self, what: str, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        if self._broken:
            raise EnvUnavailable(f"{what}: the environment timed out earlier and was abandoned")
        future = self._pool.submit(fn, *args)
        try:
            return future.result(timeout=timeout or self.timeout_s)
        except cf.TimeoutError:
            self._broken = True
            raise EnvUnavailable(
                f"{what} took longer than {timeout or self.timeout_s:.0f} s (env step timeout)"
            ) from None

    def reset(self, task: TaskSpec) -> Observation:
        return self._call(f"reset({task.name})", self._env.reset, task)

    def step(self, action: Action) -> Observation:
        return self._call(f"step({action.type.value})", self._env.step, action)

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        return self._call("evaluate", lambda: self._env.evaluate(ended_by=ended_by))

    def close(self) -> None:
        try:
            if not self._broken:
                self._call("close", self._env.close, timeout=30.0)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
