"""Killing any worker of a live run, then its Redis: the launcher's supervisor restarts the
process (or the embedded Redis), the watchdog (Celery beat) brings back the slot or trainer
task that was lost, the run goes on, and no finished trajectory is lost.

The stack is `make run`'s (hostagent.launcher.default_specs) on its own embedded Redis:
Celery env workers with real chromium, the trainer worker, the rollout worker that runs the
watchdog, Celery beat, one transformers inference worker with the shipped tiny policy, and
the router. Each worker is killed with SIGKILL, so it gets no chance to hand its task back.
Then the Redis is SIGKILLed (the supervisor restarts it on the same socket, its append-only
file brings its data back), and last it is stopped for 10 s and started without its data,
as a Redis server run without persistence comes back (every queue, lease and marker gone).
Through both, the run page's health JSON must say Redis is down, episodes must keep being
recorded, the episodes under way must finish as outcomes, and no slot may have two workers.
One run for all of it: a stack takes half a minute to start on 2 cores.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.test import Client
from django.utils import timezone

from datamanager.models import PolicyVersion, Run, ServiceOutage, Step, TrainUpdate, Trajectory
from hostagent.embedded_redis import EmbeddedRedis
from tests.live_stack import (
    Stack,
    create_started_run,
    finished,
    finished_after,
    going_on,
    live_stack,
    nothing_lost,
    page_health,
    running,
    start_workers,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def redis(tmp_path) -> EmbeddedRedis:
    return EmbeddedRedis(tmp_path / "redis" / "redis.sock")


@pytest.fixture
def stack(subprocess_env, settings, tmp_path, redis, monkeypatch):
    from dartboard.health import HealthBoard

    env = {**subprocess_env, "REDIS_URL": redis.url}
    settings.REDIS_URL = redis.url  # this process's health probes and lease reads
    # Each health request probes (no 2 s cache), so a poll right after a kill sees it.
    monkeypatch.setattr("dartboard.health.PROBE_EVERY_S", 0.0)
    monkeypatch.setattr("dartboard.health.BOARD", HealthBoard())
    with live_stack(env, tmp_path, redis=redis) as stack:
        settings.DARTBOARD_INFERENCE_URLS = [stack.router]
        yield stack


@pytest.fixture
def health_client(researcher) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(researcher)
    return client


def test_killing_each_worker_then_redis_mid_run_loses_nothing_and_the_run_goes_on(
    stack, redis, health_client
):
    run = create_started_run("faults")
    start_workers(run, stack)
    stack.wait(
        lambda: len(finished(run)) >= 4 and TrainUpdate.objects.filter(run=run).exists(),
        timeout=300,
        what="4 finished episodes and a first update",
    )

    # 1. An env worker, mid-episode if it is in one.
    before = finished(run)
    pid, killed_at = stack.kill("worker-env-0")
    running_then = list(
        Trajectory.objects.filter(
            run=run, status="running", env_slot__name__contains=f":{pid}:"
        ).values_list("pk", flat=True)
    )
    new = stack.wait(
        lambda: finished_after(run, killed_at, not_on_pid=stack.pid("worker-env-1")),
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
            t for t in finished_after(run, killed_at) if Step.objects.filter(trajectory=t).exists()
        ],
        timeout=180,
        what="an episode answered by the restarted inference worker",
    )
    versions = set(Step.objects.filter(trajectory=back[0]).values_list("policy_version", flat=True))
    assert min(versions) >= target

    # Nothing finished was lost or changed, and no step was trained twice.
    after = finished(run)
    assert {pk: after.get(pk) for pk in before} == before
    assert not Step.objects.filter(trajectory__run=run, train_uses__gt=1).exists()

    _redis_killed(stack, redis, run, health_client)
    _redis_back_without_its_data(stack, redis, run, health_client)
    outages = list(ServiceOutage.objects.filter(service="redis").order_by("started_at"))
    assert len(outages) == 2 and all(o.ended_at is not None for o in outages)
    assert outages[1].duration_s is not None and outages[1].duration_s >= 8


def _redis_killed(stack: Stack, redis: EmbeddedRedis, run: Run, client: Client) -> None:
    """SIGKILL: the page says Redis is down until the supervisor restarts it."""
    before, in_flight = finished(run), running(run)
    assert page_health(client, run)["redis"]["state"] == "up"
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGKILL)
    redis.proc.wait(timeout=10)
    seen = page_health(client, run)
    assert seen["redis"]["state"] == "down" and "Redis down since" in seen["_banner"]
    assert "connecting to" in seen["redis"]["last_error"]
    stack.supervisor.watch_once()  # the launcher's loop: restarted on the same socket
    back = timezone.now()
    stack.wait(lambda: page_health(client, run)["redis"]["state"] == "up", timeout=30,
               what="Redis up again on the page")  # fmt: skip
    going_on(stack, run, back, what="the embedded Redis was killed", episodes=1, update=False)
    nothing_lost(run, before, in_flight)


def _redis_back_without_its_data(
    stack: Stack, redis: EmbeddedRedis, run: Run, client: Client
) -> None:
    """Stopped for 10 s, back empty: every queued task, lease and marker is gone."""
    before, in_flight = finished(run), running(run)
    redis.stop()
    for leftover in redis.dir.glob("appendonly*"):
        leftover.unlink()
    stack.supervisor.redis = None  # an operator's server: nobody restarts it for us
    down_seen = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        seen = page_health(client, run)
        down_seen += seen["redis"]["state"] == "down" and "Redis down" in seen["_banner"]
        stack.supervisor.watch_once()
        time.sleep(2.5)
    assert down_seen >= 3
    redis.persist = False
    redis.start()
    stack.supervisor.redis = redis
    back = timezone.now()
    going_on(stack, run, back, what="Redis came back without its data", update=True)
    nothing_lost(run, before, in_flight)
    assert page_health(client, run)["trainer"]["state"] == "up"
