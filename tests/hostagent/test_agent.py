"""Runs own their processes: the host agent starts each run's inference worker, router,
trainer and env worker when the run starts, keeps runs apart, queues what does not fit and
stops a run's processes when it stops, and moves a run whose port another process took.
Real processes: Celery workers with chromium, the
transformers inference server, the router, the trainer (tiny policy, CPU)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from django.conf import settings

from datamanager.config import RunConfig
from datamanager.models import (
    PlacementState,
    PolicyVersion,
    Run,
    RunPlacement,
    RunStatus,
    Task,
)
from datamanager.policies import policy_path
from datamanager.services.run_workers import run_apply
from datamanager.services.runs import run_create
from hostagent.agent import HostAgent
from hostagent.placement import PORTS_PER_RUN
from rollout.client import RouterAdmin
from tests.helpers import port_base_for_runs
from tests.live_stack import FAST_LIVENESS, TASKS

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def agent(subprocess_env, settings, tmp_path, monkeypatch) -> Iterator[HostAgent]:
    """This host's agent, with two CPU inference slots, its children on the test database
    and Redis (as the launcher's children are on the launcher's)."""
    for key, value in {**subprocess_env, **FAST_LIVENESS, "DARTBOARD_PROCESSES": "per-run"}.items():
        monkeypatch.setenv(key, value)
    settings.DARTBOARD_PROCESSES = "per-run"
    settings.DARTBOARD_CPU_INFERENCE_SLOTS = 2
    agent = HostAgent(home=tmp_path, name="test-host", port_base=port_base_for_runs())
    try:
        yield agent
    finally:
        Run.objects.filter(status__in=("queued", "running", "paused")).update(status="stopped")
        agent.stop_all()


def run_config(policy: str) -> RunConfig:
    for name in TASKS:
        Task.objects.get_or_create(
            name=f"miniwob/{name}",
            defaults={"env_kind": "miniwob", "env_config": {"task": name}, "split": "train"},
        )
    return RunConfig.from_dict(
        {
            "policy": policy,
            "tasks": {"names": [f"miniwob/{n}" for n in TASKS]},
            "env": {"miniwob_slots": 1, "heartbeat_s": 0.5},
            "rollout": {"max_new_tokens": 32, "max_parse_errors": 1, "max_images": 1},
            "curation": {"n_max": 2, "n_min": 2, "dynamic_budget": False},
            "trainer": {"min_groups": 1, "max_steps_per_update": 8, "micro_batch": 4, "lr": 5e-5},
        }
    )


def tick_until(agent: HostAgent, pred: Callable[[], Any], *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        agent.tick()
        if value := pred():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s: {what} (logs: {agent.home / 'logs'})")


def status(run: Run) -> str:
    return Run.objects.get(pk=run.pk).status


def published(run: Run) -> int:
    return PolicyVersion.objects.filter(run=run, version__gte=1).count()


def test_runs_get_their_own_processes_apart_queue_when_full_and_stop_with_the_run(
    agent, monkeypatch
):
    first = run_create(name="first", config=run_config("shipped"))
    second = run_create(name="second checkpoint", config=run_config("shipped-desktop"))
    third = run_create(name="third", config=run_config("shipped"))

    # Started, a run waits for the agent, which brings up its processes and then runs it.
    assert run_apply(run_id=first.pk, action="start").status == RunStatus.QUEUED
    assert run_apply(run_id=second.pk, action="start").status == RunStatus.QUEUED
    tick_until(agent, lambda: status(first) == status(second) == RunStatus.RUNNING,
               timeout=240, what="both runs running")  # fmt: skip
    placements = {p.run_id: p for p in RunPlacement.objects.all()}
    assert placements[first.pk].router_url != placements[second.pk].router_url
    logs = agent.home / "logs"
    for run, policy in ((first, "shipped"), (second, "shipped-desktop")):
        served = (logs / f"run-{run.pk}-inference-0.log").read_text()
        assert f"serving {policy_path(policy)} v0" in served, served[-2000:]

    # No third CPU inference slot: the third run waits, saying why, and starts nothing.
    assert run_apply(run_id=third.pk, action="start").status == RunStatus.QUEUED
    for _ in range(3):
        agent.tick()
    waiting = Run.objects.get(pk=third.pk)
    assert waiting.status == RunStatus.QUEUED
    assert waiting.status_message == (
        "queued: needs 1 CPU inference worker; 0 of 2 are free on test-host "
        "(DARTBOARD_CPU_INFERENCE_SLOTS)"
    )
    assert third.pk not in agent.groups

    # Side by side, each run trains and publishes, and its own router serves its versions.
    tick_until(agent, lambda: published(first) and published(second), timeout=600,
               what="a published version in each run")  # fmt: skip
    for run in (first, second):
        latest = PolicyVersion.objects.filter(run=run).order_by("-version").first()
        url = RunPlacement.objects.get(run=run).router_url
        with RouterAdmin(url, token=settings.DARTBOARD_ADMIN_TOKEN) as admin:
            admin.wait_for_version(latest.version, timeout=120)
            workers = admin.workers()
        plan = RunPlacement.objects.get(run=run).plan
        assert [w.url for w in workers] == [f"http://127.0.0.1:{plan['worker_ports'][0]}"]
    mine = {v.checkpoint for v in PolicyVersion.objects.filter(run=first)}
    theirs = {v.checkpoint for v in PolicyVersion.objects.filter(run=second)}
    assert mine and theirs and not mine & theirs

    # Stopped, the first run's processes are gone, and the third starts in its place. Another
    # process takes the third run's worker port after the agent checked it free, as the agent
    # starts the run's processes: the worker cannot bind it, so the run's router and worker
    # move to free ports, saying so, and it runs.
    pids = [child.proc.pid for child in agent.groups[first.pk].children.values()]
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old one's TIME_WAIT
    held: list[int] = []
    start_group = agent._start_group

    def taken_as_it_starts(run, plan, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if run.pk == third.pk and not held:
            held.append(plan.worker_ports[0])
            squatter.bind(("127.0.0.1", held[0]))
            squatter.listen()
        start_group(run, plan, **kwargs)

    monkeypatch.setattr(agent, "_start_group", taken_as_it_starts)
    run_apply(run_id=first.pk, action="stop")
    try:
        placed = tick_until(agent, lambda: _placed(third), timeout=240,
                            what="the queued run placed")  # fmt: skip
        assert held == [placed.plan["worker_ports"][0]]
        moved = tick_until(agent, lambda: _moved(third, placed.router_url), timeout=120,
                           what="the third run moved off the held port")  # fmt: skip
        assert Run.objects.get(pk=third.pk).status_message == (
            f"port {held[0]} (run-{third.pk}-inference-0) was held by another process "
            f"on test-host: the run's router and inference workers moved to ports "
            f"{moved.plan['router_port']}-{moved.plan['router_port'] + PORTS_PER_RUN - 1}"
        )
        tick_until(agent, lambda: status(third) == RunStatus.RUNNING, timeout=240,
                   what="the queued run running")  # fmt: skip
        with RouterAdmin(moved.router_url, token=settings.DARTBOARD_ADMIN_TOKEN) as admin:
            assert [w.url for w in admin.workers()] == [
                f"http://127.0.0.1:{moved.plan['worker_ports'][0]}"
            ]
        assert held[0] not in moved.plan["worker_ports"]
    finally:
        squatter.close()
    assert not [pid for pid in pids if psutil.pid_exists(pid) and _alive(pid)]
    assert RunPlacement.objects.get(run=first).state == PlacementState.ENDED
    assert first.pk not in agent.groups and status(second) == RunStatus.RUNNING


def _placed(run: Run) -> RunPlacement | None:
    placement = RunPlacement.objects.get(run=run)
    return placement if placement.state == PlacementState.STARTING else None


def _moved(run: Run, router_url: str) -> RunPlacement | None:
    placement = RunPlacement.objects.get(run=run)
    return placement if placement.router_url != router_url else None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
