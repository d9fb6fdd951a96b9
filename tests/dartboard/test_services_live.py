"""The real Redis carries Celery tasks between processes and Channels events to a socket."""

import subprocess
import sys
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator

from core.procutil import terminate_pid
from dartboard.asgi import application
from datamanager.events import publish
from workers.tasks import ping

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_celery_task_round_trips_through_a_worker_process(subprocess_env):
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "dartboard",
            "worker",
            "-Q",
            "default",
            "--pool=solo",
            "-n",
            "t1@%h",
            "--without-mingle",
            "--without-gossip",
        ],
        cwd=ROOT,
        env=subprocess_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        result = ping.apply_async(queue="default").get(timeout=60)
        assert "pong" in result
    finally:
        terminate_pid(worker.pid, timeout=10)
        worker.wait()


def _logged_in_socket(client, user) -> list[tuple[bytes, bytes]]:
    """The headers of a browser socket with `user`'s session."""
    client.force_login(user)
    return [
        (b"origin", b"http://127.0.0.1"),
        (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()),
    ]


@pytest.mark.django_db(transaction=True)
def test_published_event_reaches_a_logged_in_socket(client, researcher):
    headers = _logged_in_socket(client, researcher)

    async def go():
        comm = WebsocketCommunicator(application, "/ws/runs/7/?slots=all", headers=headers)
        connected, _ = await comm.connect()
        assert connected
        await sync_to_async(publish)(run_id=7, kind="step", data={"slot": "s0", "step": 3})
        msg = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return msg

    msg = async_to_sync(go)()
    assert msg == {"kind": "step", "data": {"slot": "s0", "step": 3}}


@pytest.mark.django_db(transaction=True)
def test_a_wall_page_gets_only_its_own_slots_events_and_the_runs(client, researcher):
    """A browser on one page of a large wall subscribes to that page's slots: it gets their
    steps and the run's own events (a version, a group), never another page's steps."""
    headers = _logged_in_socket(client, researcher)

    async def go():
        page = WebsocketCommunicator(application, "/ws/runs/8/?slots=11,12", headers=headers)
        everything = WebsocketCommunicator(application, "/ws/runs/8/?slots=all", headers=headers)
        assert (await page.connect())[0] and (await everything.connect())[0]
        for slot in (11, 500, 12, 999):
            await sync_to_async(publish)(run_id=8, kind="step", data={"slot": slot, "step": 1})
        await sync_to_async(publish)(run_id=8, kind="group", data={"task": 1, "index": 2})
        got = [await page.receive_json_from(timeout=5) for _ in range(3)]
        assert await page.receive_nothing(timeout=0.5)
        seen = [await everything.receive_json_from(timeout=5) for _ in range(5)]
        await page.disconnect()
        await everything.disconnect()
        return got, seen

    got, seen = async_to_sync(go)()
    # Each slot's events and the run's travel in channel groups of their own: no order
    # between them is promised, only which arrive.
    assert sorted((m["kind"], m["data"].get("slot") or 0) for m in got) == [
        ("group", 0), ("step", 11), ("step", 12)
    ]  # fmt: skip
    assert sorted(m["data"].get("slot") or 0 for m in seen) == [0, 11, 12, 500, 999]
