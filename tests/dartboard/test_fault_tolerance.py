"""Killing any worker of a live run: the launcher's supervisor restarts the process, the
watchdog (Celery beat) brings back the slot or trainer task the dead worker held, the run
goes on, and no finished trajectory is lost.

The stack is `make run`'s (dartboard.launcher.default_specs): Celery env workers with real
chromium, the trainer worker, the rollout worker that runs the watchdog, Celery beat, one
transformers inference worker with the shipped tiny policy, and the router. Each worker is
killed with SIGKILL, so it gets no chance to hand its task back.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import datetime

import pytest
from django.utils import timezone

from dartboard.launcher import Supervisor, default_specs, wait_http
from datamanager.config import RunConfig
from datamanager.models import PolicyVersion, Run, Step, Task, TrainUpdate, Trajectory
from datamanager.policies import policy_path
from datamanager.services.runs import run_control, run_create
from workers.runs import run_start_workers

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TASKS = ("click-test-2", "click-button", "click-dialog")
FINISHED = ("succeeded", "failed")


def _two_free_ports() -> int:
    """A port p with p + 1 also free (the router and its one inference worker)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


class _Stack:
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def pid(self, name: str) -> int:
        return self.supervisor.children[name].proc.pid

    def kill(self, name: str) -> tuple[int, datetime]:
        pid = self.pid(name)
        os.kill(pid, signal.SIGKILL)
        self.supervisor.children[name].proc.wait(timeout=10)
        return pid, timezone.now()

    def wait(self, pred, *, timeout: float, what: str):
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


def _finished(run: Run) -> dict[int, tuple[str, float | None, int]]:
    rows = Trajectory.objects.filter(run=run, status__in=FINISHED)
    return {t.pk: (t.status, t.reward, t.steps.count()) for t in rows}


def _finished_after(run: Run, moment: datetime, *, not_on_pid: int | None = None):
    rows = Trajectory.objects.filter(
        run=run, status__in=FINISHED, started_at__gt=moment
    ).select_related("env_slot")
    if not_on_pid is not None:
        rows = [t for t in rows if t.env_slot and f":{not_on_pid}:" not in t.env_slot.name]
    return list(rows)


@pytest.fixture
def stack(subprocess_env, settings, tmp_path, live_work_keys_cleared):
    router_port = _two_free_ports()
    router = f"http://127.0.0.1:{router_port}"
    settings.DARTBOARD_INFERENCE_URLS = [router]
    env = {
        **subprocess_env,
        "DARTBOARD_INFERENCE_URLS": router,
        # Short leases and a fast watchdog so the test sees a recovery in seconds; the
        # defaults (30 s, 10 s, 20 s) only make it slower.
        "DARTBOARD_LEASE_TTL_S": "6",
        "DARTBOARD_WATCHDOG_PERIOD_S": "2",
        "DARTBOARD_WATCHDOG_GRACE_S": "3",
        "DARTBOARD_TORCH_THREADS": "1",
    }
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
    supervisor = Supervisor(home=tmp_path, specs=specs)
    supervisor.start()
    try:
        assert wait_http(f"{router}/health", timeout=120), "the router did not come up"
        yield _Stack(supervisor)
    finally:
        Run.objects.filter(status="running").update(status="stopped")
        supervisor.stop()


def _start_run() -> Run:
    for name in TASKS:
        Task.objects.create(
            name=f"miniwob/{name}", env_kind="miniwob", env_config={"task": name}, split="train"
        )
    run = run_create(
        name="faults",
        config=RunConfig.from_dict(
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
        ),
    )
    run_control(run_id=run.pk, action="start")
    run_start_workers(run_id=run.pk)
    return run


def test_killing_each_worker_mid_run_loses_no_finished_trajectory_and_the_run_goes_on(stack):
    run = _start_run()
    stack.wait(
        lambda: len(_finished(run)) >= 4 and TrainUpdate.objects.filter(run=run).exists(),
        timeout=300,
        what="4 finished episodes and a first update",
    )

    # 1. An env worker, mid-episode if it is in one.
    before = _finished(run)
    pid, killed_at = stack.kill("worker-env-0")
    running_then = list(
        Trajectory.objects.filter(
            run=run, status="running", env_slot__name__contains=f":{pid}:"
        ).values_list("pk", flat=True)
    )
    new = stack.wait(
        lambda: _finished_after(run, killed_at, not_on_pid=stack.pid("worker-env-1")),
        timeout=180,
        what="an episode finished by the restarted env worker",
    )
    assert f":{stack.pid('worker-env-0')}:" in new[0].env_slot.name
    for pk in running_then:  # the killed worker's episode ends with the reason, not silently
        t = stack.wait(
            lambda pk=pk: Trajectory.objects.exclude(status="running").filter(pk=pk).first(),
            timeout=60,
            what="the killed worker's episode to be ended",
        )
        assert t.status == "aborted" and "env worker stopped" in t.error

    # 2. The trainer worker: a new one resumes from the last published version.
    last_update = TrainUpdate.objects.filter(run=run).order_by("-number").first()
    published = PolicyVersion.objects.filter(run=run).order_by("-version").first()
    assert last_update is not None and published is not None
    stack.kill("worker-train")
    resumed = stack.wait(
        lambda: (
            TrainUpdate.objects.filter(run=run, number__gt=last_update.number)
            .order_by("number")
            .first()
        ),
        timeout=240,
        what="an update by the restarted trainer",
    )
    newest = PolicyVersion.objects.filter(run=run, version__lt=resumed.policy_version + 1)
    assert resumed.policy_version == newest.order_by("-version").first().version
    assert resumed.policy_version >= published.version

    # 3. The inference worker: episodes fail while it is away, then go on with the current
    # policy (the restarted worker starts from the launch version and is reloaded first).
    target = PolicyVersion.objects.filter(run=run).order_by("-version").first().version
    _, killed_at = stack.kill("inference-0")
    back = stack.wait(
        lambda: [
            t for t in _finished_after(run, killed_at) if Step.objects.filter(trajectory=t).exists()
        ],
        timeout=180,
        what="an episode answered by the restarted inference worker",
    )
    versions = set(Step.objects.filter(trajectory=back[0]).values_list("policy_version", flat=True))
    assert min(versions) >= target

    # Nothing finished was lost or changed, and no step was trained twice.
    after = _finished(run)
    assert {pk: after.get(pk) for pk in before} == before
    assert not Step.objects.filter(trajectory__run=run, train_uses__gt=1).exists()
