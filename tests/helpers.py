"""Helpers shared by the tests: a free local port, waiting for a condition, compose's
variable substitution.

port = free_port()
value = wait_until(lambda: read_status() == "up", timeout=30, what="the server")
env = {k: compose_substitute(v, {"SECRET_KEY": "s" * 50}) for k, v in service_env.items()}
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., object])

# What a fixture may need; tests/conftest.py turns each into the marker of the same name on
# every test that uses the fixture. `make test-fast` runs the tests that have none of them.
NEEDS = {
    "live": "starts servers or worker processes (a rollout server, a router, Celery, moto)",
    "browser": "starts a real chromium",
    "desktop": "starts a real Xvfb desktop",
    "gpu": "needs a CUDA GPU (skipped without one)",
}


def needs(*kinds: str) -> Callable[[F], F]:
    """Mark a fixture function (under @pytest.fixture) with what it starts."""
    unknown = set(kinds) - set(NEEDS)
    if unknown:
        raise ValueError(f"needs{kinds}: unknown {sorted(unknown)}; known: {sorted(NEEDS)}")

    def mark(func: F) -> F:
        func.dartboard_needs = frozenset(kinds) | getattr(func, "dartboard_needs", frozenset())  # type: ignore[attr-defined]
        return func

    return mark


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_base_for_runs() -> int:
    """A base port for a host agent's run port blocks (`PORTS_PER_RUN` ports a run), below the kernel's
    ephemeral range: no other test's `free_port()` and no outgoing connection takes ports
    there, so a run's inference worker cannot find its port taken between the agent's check
    and its bind. The agent itself skips blocks in use."""
    from hostagent.placement import PORTS_PER_RUN

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return random.randrange(10_000, low - PORTS_PER_RUN * 16)


def wait_until(
    condition: Callable[[], T],
    *,
    timeout: float = 60.0,
    what: str = "the condition",
    interval: float = 0.05,
    between: Callable[[], object] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy (returned); AssertionError naming
    `what` after `timeout` seconds. `between` runs before each poll (a supervisor that
    restarts what died, say)."""
    deadline = time.monotonic() + timeout
    while True:
        if between is not None:
            between()
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def redis_commands_counted(monkeypatch) -> list[int]:
    """A list that grows by one per command (or pipeline) any Redis client of this process
    sends from now on, for tests that bound the round trips a page or a pass takes."""
    import redis

    sends: list[int] = []
    real = redis.connection.AbstractConnection.send_packed_command

    def counted(self, command, check_health=True):
        sends.append(1)
        return real(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    return sends


def compose_substitute(value: object, given: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR:?message} in `value`, with `given` for the
    variables set; a required variable `given` lacks fails the test, naming it."""
    import re

    def one(match: re.Match) -> str:
        name, op, rest = match.groups()
        if name in given:
            return given[name]
        assert op == ":-", f"${{{name}}} is required ({rest}) and the test gives no value"
        return rest

    return re.sub(r"\$\{([A-Z_]+)(:[-?])([^}]*)\}", one, str(value))
