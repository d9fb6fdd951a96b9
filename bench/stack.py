"""A private Dartboard stack for benchmarks: a temporary DARTBOARD_HOME (SQLite), an
embedded Redis, env workers, a trainer worker, inference workers behind the router.

    with PrivateStack(slots=4, policy="untrained", env={"DARTBOARD_ENV_LATENCY": "osworld"}) as stack:
        ...  # Django is set up; create runs, start them, read the database

Must be entered before anything imports Django settings (it sets the environment first).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class PrivateStack:
    ROUTER_PORT = 18100
    WEB_PORT = 18000

    def __init__(
        self,
        *,
        slots: int,
        policy: str = "untrained",
        inference_workers: int = 1,
        env: dict[str, str] | None = None,
        home: Path | None = None,
        database_url: str | None = None,
        web: bool = False,
        backend: str = "transformers",
    ) -> None:
        """`web`: also serve the dashboard at `self.web_url` (for screenshots). `backend`:
        the inference workers, Dartboard's transformers server or vLLM behind its adapter."""
        self.database_url = database_url  # None: SQLite under the private home
        self.web = web
        self.web_url = f"http://127.0.0.1:{self.WEB_PORT}"
        self.slots = slots
        self.policy_name = policy
        self.inference_workers = inference_workers
        self.backend = backend
        self.home = home or Path(tempfile.mkdtemp(prefix="dartboard-bench-"))
        self.env = env or {}
        self.workers = [
            f"http://127.0.0.1:{self.ROUTER_PORT + 1 + i}" for i in range(inference_workers)
        ]

    def __enter__(self) -> PrivateStack:
        # A bench started in the background ignores SIGINT; SIGTERM must still stop the stack
        # it started (SystemExit runs __exit__), not leave workers and redis-server behind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        os.environ.update({
            "DARTBOARD_HOME": str(self.home), "DJANGO_SETTINGS_MODULE": "dartboard.settings",
            "DARTBOARD_INFERENCE_URLS": f"http://127.0.0.1:{self.ROUTER_PORT}", **self.env,
        })  # fmt: skip
        for var in ("DATABASE_URL", "REDIS_URL"):
            os.environ.pop(var, None)
        if self.database_url:
            os.environ["DATABASE_URL"] = self.database_url
        import django

        django.setup()
        from django.core.management import call_command

        from datamanager.policies import policy_path
        from hostagent.embedded_redis import EmbeddedRedis
        from hostagent.launcher import Supervisor, default_specs, wait_http

        self.redis = EmbeddedRedis(self.home / "redis" / "redis.sock")
        self.redis.start()
        call_command("migrate", verbosity=0)
        call_command("make_tiny_policy")
        call_command("import_builtin_tasks")
        self.policy = str(policy_path(self.policy_name))
        specs = default_specs(
            host="127.0.0.1",
            port=self.WEB_PORT,
            env_slots=self.slots,
            inference_policy=self.policy,
            inference_workers=self.inference_workers,
            router_port=self.ROUTER_PORT,
            backend=self.backend,
        )
        # The supervisor watches the embedded Redis as the launcher does.
        self.supervisor = Supervisor(
            home=self.home,
            specs=[s for s in specs if self.web or s.name != "web"],
            redis=self.redis,
        )
        self.supervisor.start()
        if not wait_http(f"http://127.0.0.1:{self.ROUTER_PORT}/health", timeout=300):
            self.__exit__()
            raise SystemExit(f"the router did not come up; see {self.home / 'logs'}")
        if self.web and not wait_http(f"{self.web_url}/health/", timeout=120):
            self.__exit__()
            raise SystemExit(f"the dashboard did not come up; see {self.home / 'logs'}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.supervisor.stop()  # the embedded Redis last
