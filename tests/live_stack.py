"""A live `make run` stack for tests that break things under a running run: Celery env
workers with real chromium, the trainer worker, the default worker, Celery beat (the
watchdog), one transformers inference worker with the shipped tiny policy and the router
(hostagent.launcher.default_specs, without the web: tests call the views in-process).

Used by tests/dartboard/test_fault_tolerance.py (workers killed) and test_outages.py (Redis
and the database restarted)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import SCORED_STATUSES, Run, Step, Task, TrainUpdate, Trajectory
from datamanager.policies import policy_path
from datamanager.services.runs import run_control, run_create
from hostagent.embedded_redis import EmbeddedRedis
from hostagent.launcher import Supervisor, default_specs, wait_http

TASKS = ("click-test-2", "click-button", "click-dialog")
ROOT = Path(__file__).resolve().parent.parent

# Short leases and a fast watchdog so a test sees a recovery in seconds; the defaults
# (30 s, 10 s, 20 s) only make it slower.
FAST_LIVENESS = {
    "DARTBOARD_LEASE_TTL_S": "6",
    "DARTBOARD_WATCHDOG_PERIOD_S": "2",
    "DARTBOARD_WATCHDOG_GRACE_S": "3",
    "DARTBOARD_TORCH_THREADS": "1",
}


def two_free_ports() -> int:
    """A port p with p + 1 also free (the router and its one inference worker)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return int(port)
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


class Stack:
    def __init__(self, supervisor: Supervisor, router: str, env: dict[str, str]) -> None:
        self.supervisor = supervisor
        self.router = router
        self.env = env  # what its processes run with

    def pid(self, name: str) -> int:
        return self.supervisor.children[name].proc.pid

    def kill(self, name: str) -> tuple[int, datetime]:
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        self.supervisor.children[name].proc.wait(timeout=10)
        return pid, timezone.now()

    def wait(self, pred: Callable[[], Any], *, timeout: float, what: str) -> Any:
        """Poll `pred` while the supervisor restarts what died, as the launcher does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.supervisor.watch_once()
            value = pred()
            if value:
                return value
            time.sleep(0.5)
        logs = self.supervisor.log_dir
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (logs: {logs})")


@contextlib.contextmanager
def live_stack(
    env: dict[str, str], home: Path, *, redis: EmbeddedRedis | None = None
) -> Iterator[Stack]:
    """Start the stack with `env` over the caller's; `redis` is watched and restarted by the
    supervisor as the launcher does. Everything is stopped on the way out."""
    router_port = two_free_ports()
    router = f"http://127.0.0.1:{router_port}"
    env = {**env, **FAST_LIVENESS, "DARTBOARD_INFERENCE_URLS": router}
    specs = [
        s
        for s in default_specs(
            host="127.0.0.1",
            port=0,
            env_slots=2,
            inference_policy=str(policy_path("shipped")),
            router_port=router_port,
        )
        if s.name != "web"
    ]
    for spec in specs:
        spec.env = {**spec.env, **env}
    supervisor = Supervisor(home=home, specs=specs, redis=redis)
    if redis is not None:
        redis.start()
    supervisor.start()
    try:
        assert wait_http(f"{router}/health", timeout=120), "the router did not come up"
        yield Stack(supervisor, router, env)
    finally:
        Run.objects.filter(status="running").update(status="stopped")
        supervisor.stop()


def fault_run_config() -> RunConfig:
    """Three easy MiniWoB++ tasks, two slots, an update per ready group."""
    for name in TASKS:
        Task.objects.get_or_create(
            name=f"miniwob/{name}",
            defaults={"env_kind": "miniwob", "env_config": {"task": name}, "split": "train"},
        )
    return RunConfig.from_dict(
        {
            "policy": "shipped",
            "tasks": {"names": [f"miniwob/{n}" for n in TASKS]},
            "env": {"miniwob_slots": 2, "heartbeat_s": 0.5},
            "rollout": {"max_new_tokens": 32, "max_parse_errors": 1, "max_images": 1},
            "curation": {"n_max": 4, "n_min": 2},
            "trainer": {
                "min_groups": 1,
                "max_steps_per_update": 16,
                "micro_batch": 4,
                "kl_coef": 0.0,
                "lr": 5e-5,
            },
        }
    )


def create_started_run(name: str) -> Run:
    """A created and started run (its worker tasks are the caller's to enqueue)."""
    run = run_create(name=name, config=fault_run_config())
    run_control(run_id=run.pk, action="start")
    return run


def finished(run: Run) -> dict[int, tuple[str, float | None, int]]:
    """Every finished trajectory: (status, reward, steps)."""
    rows = Trajectory.objects.filter(run=run, status__in=SCORED_STATUSES)
    return {t.pk: (t.status, t.reward, t.steps.count()) for t in rows}


def finished_after(run: Run, moment: datetime, *, not_on_pid: int | None = None) -> list:
    rows = Trajectory.objects.filter(
        run=run, status__in=SCORED_STATUSES, started_at__gt=moment
    ).select_related("env_slot")
    if not_on_pid is not None:
        rows = [t for t in rows if t.env_slot and f":{not_on_pid}:" not in t.env_slot.name]
    return list(rows)


def slots_served_twice(run: Run) -> list[str]:
    """Episodes of one env slot (backend:index) that overlapped in time on two workers."""
    spans: dict[str, list[tuple[datetime, datetime, str]]] = {}
    now = timezone.now()
    for t in Trajectory.objects.filter(run=run, env_slot__isnull=False).select_related("env_slot"):
        slot = t.env_slot.name.split(":", 2)[-1]  # host:pid:backend:index -> backend:index
        worker = t.env_slot.name
        end = t.finished_at or now
        if t.status == "aborted" and "stopped mid-episode" in t.error:
            # A killed worker's episode, ended by the watchdog later: nobody served it after
            # its last step (the restarted worker may start a new one before the abort).
            last = t.steps.order_by("-index").values_list("created_at", flat=True).first()
            end = last or t.started_at
        spans.setdefault(slot, []).append((t.started_at, end, worker))
    clashes = []
    for slot, items in spans.items():
        items.sort()
        latest_end, holder = items[0][1], items[0][2]
        for start, end, worker in items[1:]:
            if worker != holder and start < latest_end:
                clashes.append(f"{slot}: {holder} until {latest_end:%T}, {worker} from {start:%T}")
            if end > latest_end:
                latest_end, holder = end, worker
    return clashes


def trained_twice(run: Run) -> int:
    return Step.objects.filter(trajectory__run=run, train_uses__gt=1).count()


def start_workers(run: Run, stack: Stack) -> None:
    """Enqueue the run's tasks from a process of the stack's own configuration (its Redis,
    which may not be this process's)."""
    code = f"from datamanager.services.run_workers import run_start_workers; run_start_workers(run_id={run.pk})"
    subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT, env=stack.env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip


def running(run: Run) -> list[int]:
    return list(Trajectory.objects.filter(run=run, status="running").values_list("pk", flat=True))


def under_way(stack: Stack, run: Run) -> None:
    """The run has finished episodes and has one under way: something to carry through."""
    stack.wait(lambda: len(finished(run)) >= 2 and running(run), timeout=300,
               what="2 finished episodes and one under way")  # fmt: skip


def going_on(stack: Stack, run: Run, since: datetime, *, what: str, episodes: int = 2,
             update: bool) -> None:  # fmt: skip
    """Episodes that started after `since` finish (and, with `update`, a trainer update
    follows)."""
    updates = TrainUpdate.objects.filter(run=run).count()
    stack.wait(lambda: len(finished_after(run, since)) >= episodes, timeout=180,
               what=f"{episodes} episodes started after {what}")  # fmt: skip
    if update:
        stack.wait(lambda: TrainUpdate.objects.filter(run=run).count() > updates, timeout=180,
                   what=f"a trainer update after {what}")  # fmt: skip


def nothing_lost(run: Run, before: dict, in_flight: list[int]) -> None:
    """Finished trajectories unchanged, the episodes under way when it broke finished as
    policy outcomes (not lost as errors), no step trained twice, no slot on two workers."""
    after = finished(run)
    assert {pk: after.get(pk) for pk in before} == before
    ended = dict(Trajectory.objects.filter(pk__in=in_flight).values_list("pk", "status"))
    assert all(status in ("succeeded", "failed", "running") for status in ended.values()), ended
    assert trained_twice(run) == 0
    assert slots_served_twice(run) == []


def page_health(client: Any, run: Run) -> dict[str, Any]:
    """The run page's health JSON: each service by name, and the banner under `_banner`."""
    response = client.get(f"/runs/{run.pk}/health.json", HTTP_ACCEPT="application/json")
    body = response.json()
    return {"_banner": body.get("banner", ""), **{s["service"]: s for s in body["services"]}}
