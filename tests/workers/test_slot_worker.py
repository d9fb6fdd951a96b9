"""Env slots on real Celery worker processes with real chromium: concurrent episodes,
heartbeats, and recovery from a browser killed mid-episode. The scripted oracle stands in
for the policy (through the same parse -> map -> step path a model's output takes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.utils import timezone

from core.procutil import pid_cmdline, terminate_pid
from datamanager.config import RunConfig
from datamanager.models import EnvSlot, Run, Task, Trajectory
from datamanager.services.episodes import taskstats_ensure
from datamanager.services.run_workers import run_start_workers
from datamanager.services.runs import run_control, run_create

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ROOT = Path(__file__).resolve().parents[2]


def _worker(env: dict[str, str], name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "dartboard",
            "worker",
            "-Q",
            "env",
            "--pool=solo",
            "-n",
            f"{name}@%h",
            "--without-mingle",
            "--without-gossip",
            "--loglevel=WARNING",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _oracle_run(slots: int, *, mode: str = "decoupled", start_workers: bool = True) -> Run:
    """A running oracle run over click-test and click-button; `start_workers` enqueues its
    slot tasks (the decoupled design), else only its task stats exist (a caller drives it)."""
    for name in ("click-test", "click-button"):
        Task.objects.create(
            name=f"miniwob/{name}",
            env_kind="miniwob",
            env_config={"task": name, "episode_seconds": 60},
        )
    run = run_create(
        name="slots",
        config=RunConfig.from_dict(
            {
                "mode": mode,
                "policy": "oracle",
                "tasks": {"names": ["miniwob/click-test", "miniwob/click-button"]},
                "env": {"miniwob_slots": slots, "heartbeat_s": 0.5},
            }
        ),
    )
    run_control(run_id=run.pk, action="start")
    if start_workers:
        run_start_workers(run_id=run.pk)
    else:
        taskstats_ensure(run=run)  # what starting a run does, without its drivers
    return run


def _stop(run: Run, workers: list[subprocess.Popen]) -> None:
    run_control(run_id=run.pk, action="stop")
    for w in workers:
        terminate_pid(w.pid, timeout=20)
        w.wait()


def test_two_worker_processes_run_episodes_at_once_with_heartbeats(subprocess_env):
    workers = [_worker(subprocess_env, f"envA{i}") for i in range(2)]
    try:
        run = _oracle_run(slots=2)

        # Oracle episodes end with their task's click (about a second each), so one worker
        # can finish six before the other has started: wait for both slots' episodes.
        def both_slots_done_six():
            done = Trajectory.objects.filter(run=run, status="succeeded")
            return (
                done.count() >= 6 and done.order_by().values("env_slot_id").distinct().count() == 2
            )

        _wait(both_slots_done_six, 120, "six successful oracle episodes on both slots")
        slots = list(EnvSlot.objects.filter(run=run))
        assert len(slots) == 2 and len({s.name.split(":")[1] for s in slots}) == 2  # two pids
        assert all((timezone.now() - s.last_heartbeat).total_seconds() < 10 for s in slots)
        # Episodes of the two slots overlapped in time: they ran at once.
        by_slot = {}
        for t in Trajectory.objects.filter(run=run, status="succeeded"):
            by_slot.setdefault(t.env_slot_id, []).append((t.started_at, t.finished_at))
        assert len(by_slot) == 2
        (a, b) = by_slot.values()
        assert any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)
        assert not Trajectory.objects.filter(run=run, status="error").exists()
        # Each slot reports how long its environment has been busy (the utilisation figure):
        # more than nothing, less than the slot has existed.
        _wait(
            lambda: all(s.env_busy_s > 0 for s in EnvSlot.objects.filter(run=run)),
            20,
            "both slots to report environment busy time",
        )
        for s in EnvSlot.objects.filter(run=run):
            assert s.env_busy_s < (timezone.now() - s.created_at).total_seconds()
            # and the disk its worker's home is on (the host map's disk line)
            assert 0 < s.disk_free_bytes <= s.disk_total_bytes
    finally:
        _stop(run, workers)


def test_a_lockstep_round_runs_one_episode_per_worker_turn_by_turn(subprocess_env):
    """The synchronous baseline's round: one episode per slot on separate worker
    processes, paced by the Redis lockstep; both arrive at turn 0 (after both resets) and
    leave the round when their episode is over."""
    import redis
    from django.conf import settings

    from dartboard.celery import app

    workers = [_worker(subprocess_env, f"envL{i}") for i in range(2)]
    run = None
    try:
        run = _oracle_run(2, mode="synchronous", start_workers=False)
        key = f"dartboard:lockstep:{run.pk}:test-{uuid.uuid4().hex}"  # the Redis may outlive the DB
        lockstep = {"key": key, "members": 2, "timeout_s": 90}
        results = [
            app.send_task(
                "workers.tasks.episode_once", args=(run.pk, "miniwob", i, lockstep), queue="env"
            )
            for i in range(2)
        ]
        assert [r.get(timeout=120) for r in results] == ["1 episodes done"] * 2
        done = Trajectory.objects.filter(run=run)
        assert sorted(done.values_list("status", flat=True)) == ["succeeded", "succeeded"]
        assert done.values("env_slot_id").distinct().count() == 2
        r = redis.Redis.from_url(settings.REDIS_URL)
        assert int(r.get(f"{key}:at:0")) == 2  # both arrived at the first turn
        assert r.get(f"{key}:at:1") is None  # a click ends the task: nobody took turn 1
        assert r.hgetall(f"{key}:left") == {b"0": b"2"}
    finally:
        if run is not None:
            _stop(run, workers)
        else:
            for w in workers:
                terminate_pid(w.pid, timeout=20)


def _our_chromium_children(worker_pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        cmd = pid_cmdline(int(entry)) or ""
        # the browser's main process: a direct child of the Playwright driver, which is a
        # child of the worker; match on the ancestry, never on the name alone
        if "chromium" in cmd and "--type=" not in cmd and _has_ancestor(int(entry), worker_pid):
            pids.append(int(entry))
    return pids


def _has_ancestor(pid: int, ancestor: int) -> bool:
    for _ in range(10):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if ppid == ancestor:
            return True
        if ppid <= 1:
            return False
        pid = ppid
    return False


def test_browser_killed_mid_episode_errors_that_trajectory_and_the_slot_recovers(subprocess_env):
    env = {
        **subprocess_env,
        "DARTBOARD_ENV_LATENCY": "osworld",
        "DARTBOARD_ENV_LATENCY_SCALE": "0.05",
    }
    worker = _worker(env, "envK")
    try:
        run = _oracle_run(slots=1)
        _wait(
            lambda: Trajectory.objects.filter(run=run, status="succeeded").exists(),
            120,
            "a first successful episode",
        )
        running = _wait(
            lambda: Trajectory.objects.filter(run=run, status="running").first(),
            60,
            "an episode in progress",
        )
        browsers = _wait(lambda: _our_chromium_children(worker.pid), 10, "the worker's chromium")
        for pid in browsers:  # the sandbox's bwrap and chromium: one kill may take the rest
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        broken = _wait(
            lambda: Trajectory.objects.filter(pk=running.pk, status="error").first(),
            90,
            "the killed episode to be marked error",
        )
        assert broken.error  # the reason is recorded
        before = Trajectory.objects.filter(run=run, status="succeeded").count()
        _wait(
            lambda: Trajectory.objects.filter(run=run, status="succeeded").count() > before,
            120,
            "a successful episode after recovery",
        )
        # The worker clears the slot's failure count just after it records the episode's end.
        _wait(
            lambda: EnvSlot.objects.filter(
                run=run, status__in=("idle", "busy"), consecutive_failures=0
            ).exists(),
            30,
            "the slot's failure count cleared after a successful episode",
        )
        slot = EnvSlot.objects.get(run=run)
        assert "EnvUnavailable" in slot.last_error or "Error" in slot.last_error
        finished = Trajectory.objects.filter(run=run).exclude(status="running")
        assert finished.filter(status="error").count() >= 1
    finally:
        _stop(run, [worker])


def test_a_lockstep_member_that_never_arrives_is_said_on_the_run(subprocess_env):
    """A round of three with only two slot tasks (the third worker died): both episodes
    still finish after the wait, and the run says why its round stalled."""
    from dartboard.celery import app

    workers = [_worker(subprocess_env, f"envM{i}") for i in range(2)]
    run = None
    try:
        run = _oracle_run(2, mode="synchronous", start_workers=False)
        lockstep = {
            "key": f"dartboard:lockstep:{run.pk}:test-{uuid.uuid4().hex}",
            "members": 3,
            "timeout_s": 3,
        }
        results = [
            app.send_task(
                "workers.tasks.episode_once", args=(run.pk, "miniwob", i, lockstep), queue="env"
            )
            for i in range(2)
        ]
        assert [r.get(timeout=120) for r in results] == ["1 episodes done"] * 2
        assert Trajectory.objects.filter(run=run, status="succeeded").count() == 2
        message = Run.objects.get(pk=run.pk).status_message
        assert "never arrived" in message and "waited 3 s" in message
    finally:
        if run is not None:
            _stop(run, workers)
