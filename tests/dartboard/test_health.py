"""The run page's health line and outage banner (dartboard/health.py): each service up or
down since when, with its last error, and outages kept with their durations. Real Redis
(a private one the test stops and starts), a real closed port for the router."""

from __future__ import annotations

import pytest
from django.test import Client

from datamanager.models import ServiceOutage
from hostagent.embedded_redis import EmbeddedRedis
from tests.datamanager.factories import make_running_run, make_tasks
from tests.helpers import free_port, needs

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _probe_every_request(monkeypatch):
    from dartboard.health import HealthBoard

    monkeypatch.setattr("dartboard.health.PROBE_EVERY_S", 0.0)
    monkeypatch.setattr("dartboard.health.BOARD", HealthBoard())  # no state from other tests


@pytest.fixture
@needs("live")
def private_redis(settings, tmp_path):
    redis = EmbeddedRedis(tmp_path / "r" / "redis.sock")
    redis.start()
    settings.REDIS_URL = redis.url
    yield redis
    redis.stop()


def _services(client: Client, run_id: int) -> tuple[dict[str, dict], str]:
    body = client.get(f"/runs/{run_id}/health.json").json()
    return {s["service"]: s for s in body["services"]}, body["banner"]


def test_a_stopped_redis_is_shown_down_with_its_error_then_up_and_kept_as_an_outage(
    ada_client, private_redis, settings
):
    settings.DARTBOARD_INFERENCE_URLS = [f"http://127.0.0.1:{free_port()}"]
    make_tasks(1)
    run = make_running_run()
    services, _ = _services(ada_client, run.pk)
    assert services["redis"]["state"] == "up" and services["database"]["state"] == "up"
    # Nothing changed yet: "since" is only the web's first probe, and the page says so.
    assert not services["redis"]["changed"]
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "Redis up at every check since" in page and "Redis up since" not in page

    private_redis.stop()
    services, banner = _services(ada_client, run.pk)
    assert services["redis"]["state"] == "down"
    assert "connecting to" in services["redis"]["last_error"]
    assert services["trainer"]["state"] == "unknown"  # its lease cannot be read
    assert banner.startswith("Outage: ") and "Redis down since" in banner
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert 'class="svc down" data-service="redis"' in page and "Redis down since" in page
    assert ServiceOutage.objects.get(service="redis", ended_at=None)

    private_redis.start()
    services, banner = _services(ada_client, run.pk)
    assert services["redis"]["state"] == "up" and "Redis" not in banner
    assert services["redis"]["changed"] and not services["database"]["changed"]
    assert "Redis up since" in ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert services["redis"]["last_error"]  # still reachable from the page
    outage = ServiceOutage.objects.get(service="redis")
    assert outage.ended_at is not None and outage.duration_s >= 0
    assert "Recent outages" in ada_client.get(f"/runs/{run.pk}/").content.decode()


def test_an_unreachable_router_is_an_outage_that_names_its_address(ada_client, settings):
    port = free_port()
    settings.DARTBOARD_INFERENCE_URLS = [f"http://127.0.0.1:{port}"]
    make_tasks(1)
    run = make_running_run()
    services, banner = _services(ada_client, run.pk)
    assert services["router"]["state"] == "down"
    assert f"127.0.0.1:{port}" in services["router"]["last_error"]
    assert services["inference"]["state"] == "unknown"
    assert "Router down since" in banner


def test_the_trainer_is_up_while_a_worker_holds_its_lease(ada_client, settings,
                                                         live_work_keys_cleared):  # fmt: skip
    from datamanager.live_work import redis_client, trainer_work

    settings.DARTBOARD_INFERENCE_URLS = [f"http://127.0.0.1:{free_port()}"]
    make_tasks(1)
    run = make_running_run()
    services, _ = _services(ada_client, run.pk)
    assert services["trainer"]["state"] == "down"
    client = redis_client()
    client.set(trainer_work(run_id=run.pk, mode="decoupled").lease_key, "gpu-1:42:trainer", ex=30)
    client.close()
    services, _ = _services(ada_client, run.pk)
    assert services["trainer"]["state"] == "up" and "gpu-1:42" in services["trainer"]["detail"]
