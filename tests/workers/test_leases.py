"""Leases across a Redis outage (real Redis): a live holder takes its lease back when Redis
returns without its data; a holder whose lease went to another worker meanwhile learns it
and stops, so no slot or trainer has two workers."""

from __future__ import annotations

import time

import pytest

from datamanager.live_work import redis_client
from datamanager.models import EnvSlot
from workers.leases import LeaseKeeper, RedisLease
from workers.slot_worker import _Heartbeat, _SlotBusy

KEY = "dartboard:slot-lease:999999:miniwob:0"


@pytest.fixture
def client():
    redis = redis_client()
    redis.delete(KEY)
    yield redis
    redis.delete(KEY)
    redis.close()


def _until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_live_holder_takes_its_lease_back_after_redis_lost_it(client):
    lease = RedisLease(key=KEY, holder="host:1:a", ttl_s=1.5)
    assert lease.acquire() is None
    keeper = LeaseKeeper(lease)
    keeper.start()
    try:
        client.delete(KEY)  # what a Redis restart without its data does
        assert _until(lambda: client.get(KEY) == b"host:1:a")
        assert not keeper.lost.is_set()
    finally:
        keeper.finish()
    assert client.get(KEY) is None  # released on finish


def test_a_holder_whose_lease_was_taken_meanwhile_stops(client):
    lease = RedisLease(key=KEY, holder="host:1:a", ttl_s=1.5)
    assert lease.acquire() is None
    keeper = LeaseKeeper(lease)
    keeper.start()
    try:
        client.set(KEY, "host:2:b", ex=60)  # lapsed in an outage; another worker took it
        assert _until(keeper.lost.is_set)
    finally:
        keeper.finish()
    assert client.get(KEY) == b"host:2:b"  # finishing does not release another's lease


@pytest.mark.django_db(transaction=True)
def test_a_slot_heartbeat_that_finds_its_lease_taken_tells_the_slot_to_leave(client):
    slot = EnvSlot.objects.create(name="host:1:miniwob:0", host="host", backend="miniwob")
    lease = RedisLease(key=KEY, holder="host:1:miniwob:0", ttl_s=1.5)
    assert lease.acquire() is None
    beat = _Heartbeat(slot.pk, 0.1, lease, _SlotBusy(0.0))
    beat.start()
    try:
        time.sleep(0.3)
        assert not beat.lost.is_set()  # renewing its own lease
        client.set(KEY, "host:2:miniwob:0", ex=60)
        assert _until(beat.lost.is_set)
    finally:
        beat.stop_event.set()
        beat.join(5)
        lease.release()
    assert client.get(KEY) == b"host:2:miniwob:0"


def test_leases_renew_extends_ours_in_one_pipeline_and_names_the_ones_taken(client):
    from workers.leases import leases_renew

    other = KEY.replace(":0", ":1")
    client.delete(other)
    try:
        client.set(KEY, "host:1:a", ex=5)
        client.set(other, "host:2:b", ex=5)  # another worker holds this one
        lost = leases_renew(client, {KEY: "host:1:a", other: "host:1:a"}, ttl_s=60)
        assert lost == {other}
        assert client.ttl(KEY) > 50  # renewed to the new TTL
        assert client.get(other) == b"host:2:b" and client.ttl(other) <= 5  # left alone
        client.delete(KEY)  # lapsed (a Redis restart): taken again, as RedisLease.renew does
        assert leases_renew(client, {KEY: "host:1:a"}, ttl_s=60) == set()
        assert client.get(KEY) == b"host:1:a"
    finally:
        client.delete(other)
