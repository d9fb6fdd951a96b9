"""Env slot services: the batched heartbeat of a process that serves many slots."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from datamanager.models import EnvSlot
from datamanager.services.env_slots import env_slots_heartbeat

pytestmark = pytest.mark.django_db


def _slot(name: str) -> EnvSlot:
    old = timezone.now() - timedelta(minutes=5)
    return EnvSlot.objects.create(
        name=name, host="h", backend="sim", last_heartbeat=old, env_busy_s=1.0
    )


def test_one_statement_beats_for_every_slot_with_its_own_busy_time() -> None:
    a, b, other = _slot("h:1:sim:0"), _slot("h:1:sim:1"), _slot("h:2:sim:2")
    before = timezone.now()
    with CaptureQueriesContext(connection) as queries:
        assert env_slots_heartbeat(busy_s={a.pk: 12.5, b.pk: 30.0}) == 2
    assert len(queries) == 1
    a.refresh_from_db(), b.refresh_from_db(), other.refresh_from_db()
    assert (a.env_busy_s, b.env_busy_s, other.env_busy_s) == (12.5, 30.0, 1.0)
    assert a.last_heartbeat >= before and b.last_heartbeat >= before
    assert other.last_heartbeat < before  # a slot of another process is not touched


def test_no_slots_no_statement() -> None:
    with CaptureQueriesContext(connection) as queries:
        assert env_slots_heartbeat(busy_s={}) == 0
    assert not queries
