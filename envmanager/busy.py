"""How much of a worker's time its environment is busy: the environment-utilisation figure.

`BusyEnv` wraps a process's env and times every reset/step/evaluate on one `BusyClock`.
`BusyClock.seconds()` includes the call under way, so a reader sampling it mid-episode (the
slot heartbeat, which stores it on the `EnvSlot` row) does not count a 40-second reset as idle
just because it has not returned yet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from core.protocol import Action, ActionType, Env, Evaluation, Observation, TaskSpec


class BusyClock:
    """Busy seconds of one worker's environment. `now` is injectable (tests)."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._total = 0.0
        self._since: float | None = None

    def start(self) -> None:
        with self._lock:
            self._since = self._now()

    def stop(self) -> None:
        with self._lock:
            if self._since is not None:
                self._total += self._now() - self._since
                self._since = None

    def seconds(self) -> float:
        """Busy seconds so far, the call under way included."""
        with self._lock:
            running = 0.0 if self._since is None else self._now() - self._since
            return self._total + running


# The worker process's clock: one env per process and backend, one slot task at a time.
PROCESS_CLOCK = BusyClock()


class BusyEnv:
    """An Env whose calls are timed on `clock` (injected latency included when wrapped)."""

    def __init__(self, env: Env, clock: BusyClock) -> None:
        self.env = env
        self.kind = env.kind
        self.clock = clock

    def _timed(self, fn: Any, *args: Any) -> Any:
        self.clock.start()
        try:
            return fn(*args)
        finally:
            self.clock.stop()

    def reset(self, task: TaskSpec) -> Observation:
        return self._timed(self.env.reset, task)

    def step(self, action: Action) -> Observation:
        return self._timed(self.env.step, action)

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        return self._timed(lambda: self.env.evaluate(ended_by=ended_by))

    def close(self) -> None:
        self.env.close()
