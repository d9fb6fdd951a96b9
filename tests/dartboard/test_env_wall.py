"""The run page's env wall as a researcher reads it: each slot's latest screenshot, task,
step, status and how busy it has been; who holds the slots; a wall of hundreds, paged."""

from __future__ import annotations

import re

import pytest

from datamanager.models import EnvSlot, Run, Step, Trajectory
from tests.dartboard.run_helpers import episode, make_run
from tests.helpers import redis_commands_counted

pytestmark = pytest.mark.django_db


def test_run_page_env_wall_shows_latest_screenshot_task_step_and_status(ada_client):
    run = make_run()
    busy = EnvSlot.objects.create(name="h:1:0", host="h", backend="miniwob", run=run)
    sick = EnvSlot.objects.create(
        name="h:1:1",
        host="h",
        backend="miniwob",
        run=run,
        status="quarantined",
        last_error="chromium died 3 times",
    )
    traj = episode(run, busy, steps=3, success=None, version=2)
    html = ada_client.get(f"/runs/{run.pk}/").content.decode()
    tile = re.search(rf'<a class="tile" data-slot="{busy.pk}".*?</a>', html, re.S).group(0)
    last = Step.objects.get(trajectory=traj, index=2)
    assert f'src="/media/{last.screenshot.name}"' in tile
    assert f'href="/trajectories/{traj.pk}/"' in tile
    assert traj.task.name in tile and '<span class="step">2</span>' in tile and "v2" in tile
    tile2 = re.search(rf'<a class="tile" data-slot="{sick.pk}".*?</a>', html, re.S).group(0)
    assert "quarantined" in tile2 and "chromium died 3 times" in tile2
    assert ada_client.get(f"/runs/{run.pk}/slots.json").json()["slots"][0]["step"] == 2


def test_a_slot_tile_shows_how_busy_its_environment_has_been(ada_client):
    """A worker alive for 200 s whose env spent 150 s in reset/step/evaluate: 75%."""
    from datetime import timedelta

    run = make_run()
    slot = EnvSlot.objects.create(name="h:1:0", host="h", backend="miniwob", run=run)
    EnvSlot.objects.filter(pk=slot.pk).update(
        env_busy_s=150.0, last_heartbeat=slot.created_at + timedelta(seconds=200)
    )
    html = ada_client.get(f"/runs/{run.pk}/").content.decode()
    tile = re.search(rf'<a class="tile" data-slot="{slot.pk}".*?</a>', html, re.S).group(0)
    assert "env busy 75%" in tile
    assert ada_client.get(f"/runs/{run.pk}/slots.json").json()["slots"][0]["env_busy"] == 0.75


def test_a_slot_whose_worker_stopped_heart_beating_shows_as_lost(ada_client):
    """A killed worker cannot say so itself: its tile turns `lost` once its heartbeat is
    older than the bound that also ends its episode (3 x heartbeat_s + 10 s)."""
    from datetime import timedelta

    from django.utils import timezone

    run = make_run(env={"heartbeat_s": 2.0})
    alive = EnvSlot.objects.create(name="h:1:miniwob:0", host="h", backend="miniwob", run=run)
    dead = EnvSlot.objects.create(name="h:2:miniwob:1", host="h", backend="miniwob", run=run)
    EnvSlot.objects.filter(pk__in=[alive.pk, dead.pk]).update(status="busy")
    EnvSlot.objects.filter(pk=alive.pk).update(last_heartbeat=timezone.now())
    EnvSlot.objects.filter(pk=dead.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=40))
    html = ada_client.get(f"/runs/{run.pk}/").content.decode()

    def tile(slot):
        return re.search(rf'<a class="tile" data-slot="{slot.pk}".*?</a>', html, re.S).group(0)

    assert ">busy<" in tile(alive) and "lost" not in tile(alive)
    assert ">lost<" in tile(dead)
    assert re.search(r"no heartbeat for 4\d s: its worker stopped", tile(dead))
    statuses = {
        s["name"]: s["status"] for s in ada_client.get(f"/runs/{run.pk}/slots.json").json()["slots"]
    }
    assert statuses == {"h:1:miniwob:0": "busy", "h:2:miniwob:1": "lost"}


def test_the_run_page_says_who_holds_each_slot_and_the_trainer(ada_client, live_work_keys_cleared):
    from datamanager.live_work import redis_client, slot_work

    run = make_run(env={"miniwob_slots": 2})
    client = redis_client()
    client.set(slot_work(run_id=run.pk, backend="miniwob", index=0).lease_key, "h:42:miniwob:0")
    client.set(slot_work(run_id=run.pk, backend="miniwob", index=1).pending_key, "1")
    client.close()
    text = re.sub(r"\s+", " ", ada_client.get(f"/runs/{run.pk}/").content.decode())

    assert "slot miniwob:0: held by h:42:miniwob:0" in text
    assert "slot miniwob:1: queued on env" in text and "queued on env behind" not in text
    assert "trainer: no live worker; the watchdog enqueues it again after 20 s" in text

    # While the run evaluates a version, a queued slot says what it waits behind.
    from datamanager.models import EvalJob, EvalStatus

    EvalJob.objects.create(name="v4", run=run, policy_version=4, status=EvalStatus.RUNNING)
    text = re.sub(r"\s+", " ", ada_client.get(f"/runs/{run.pk}/").content.decode())
    assert "slot miniwob:1: queued on env behind the evaluation of v4" in text


def test_with_redis_down_the_run_page_says_who_holds_the_slots_is_unknown(
    ada_client, settings, tmp_path
):
    settings.REDIS_URL = f"unix://{tmp_path / 'no-redis.sock'}"  # nothing listens there
    run = make_run(env={"miniwob_slots": 2})
    text = re.sub(r"\s+", " ", ada_client.get(f"/runs/{run.pk}/").content.decode())
    assert "workers: Redis unreachable, live state unavailable:" in text
    assert "slot miniwob:0" not in text


def test_a_wall_of_130_slots_is_paged_counted_and_filterable(ada_client):
    """1,000 tiles are neither readable nor cheap: the wall shows a page of 60, counts every
    status, and filters by status (`lost` included) and by slot or task name."""
    from datetime import timedelta

    from django.utils import timezone

    run = make_run(env={"miniwob_slots": 0, "sim_slots": 130})
    EnvSlot.objects.bulk_create(
        [
            EnvSlot(name=f"w:{i:03d}", key=f"sim:{i}", host="w", backend="sim", run=run,
                    status="quarantined" if i % 10 == 3 else "busy",
                    last_heartbeat=timezone.now())
            for i in range(130)
        ]
    )  # fmt: skip
    EnvSlot.objects.filter(name="w:007").update(last_heartbeat=timezone.now() - timedelta(hours=1))
    episode(run, EnvSlot.objects.get(name="w:120"), steps=2, success=None)

    def tiles(html: str) -> list[str]:
        return re.findall(
            r'<a class="tile" data-slot="\d+".*?<span class="name">([^<]*)<', html, re.S
        )

    html = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert tiles(html) == [f"w:{i:03d}" for i in range(60)]
    assert "116 busy" in html and "13 quarantined" in html and "1 lost" in html
    assert "page 1 of 3" in html and 'data-complete="1"' not in html
    page3 = ada_client.get(f"/runs/{run.pk}/?page=3").content.decode()
    assert tiles(page3) == [f"w:{i:03d}" for i in range(120, 130)]
    quarantined = ada_client.get(f"/runs/{run.pk}/?status=quarantined").content.decode()
    assert tiles(quarantined) == [f"w:{i:03d}" for i in range(3, 130, 10)]
    lost = ada_client.get(f"/runs/{run.pk}/slots.json?status=lost").json()
    assert [s["name"] for s in lost["slots"]] == ["w:007"] and lost["total"] == 1
    task = Trajectory.objects.get(env_slot__name="w:120").task.name
    EnvSlot.objects.filter(name="w:120").update(
        current_trajectory=Trajectory.objects.get(env_slot__name="w:120")
    )
    by_task = ada_client.get(f"/runs/{run.pk}/slots.json?q={task}").json()
    assert [s["name"] for s in by_task["slots"]] == ["w:120"] and by_task["slots"][0]["step"] == 1
    page2 = ada_client.get(f"/runs/{run.pk}/slots.json?page=2").json()
    assert (len(page2["slots"]), page2["page"], page2["pages"], page2["total"]) == (60, 2, 3, 130)
    assert page2["counts"] == {"busy": 116, "quarantined": 13, "lost": 1}
    wide = ada_client.get(f"/runs/{run.pk}/?per=100&page=2").content.decode()
    assert tiles(wide) == [f"w:{i:03d}" for i in range(100, 130)] and "page 2 of 2" in wide
    assert "per=100&amp;page=1" in wide  # the pager keeps the page's width
    everything = ada_client.get(f"/runs/{run.pk}/slots.json?per=100000").json()
    assert (len(everything["slots"]), everything["pages"]) == (130, 1)  # held to MAX_SLOTS


def test_the_run_page_reads_500_slot_leases_in_a_few_round_trips_and_folds_them(
    ada_client, live_work_keys_cleared, monkeypatch
):
    from datamanager.live_work import redis_client, slot_work

    run = make_run(policy="oracle", env={"miniwob_slots": 0, "sim_slots": 500})
    client = redis_client()
    pipe = client.pipeline()
    for i in range(499):  # slot 499 has no worker
        pipe.set(slot_work(run_id=run.pk, backend="sim", index=i).lease_key, f"h:1:sim:{i}")
    pipe.execute()
    client.close()
    sends = redis_commands_counted(monkeypatch)
    text = re.sub(r"\s+", " ", ada_client.get(f"/runs/{run.pk}/").content.decode())
    assert len(sends) <= 20  # one round trip a lease: 1,000 for this page
    assert "499 slots: held by live workers" in text
    assert "slot sim:499: no live worker" in text and "slot sim:3:" not in text
    Run.objects.filter(pk=run.pk).update(config={**run.config, "env": {**run.config["env"], "sim_slots": 600}})  # fmt: skip
    text = re.sub(r"\s+", " ", ada_client.get(f"/runs/{run.pk}/").content.decode())
    assert "slot sim:518: no live worker" in text and "slot sim:519" not in text
    assert "81 more: queued or without a worker" in text  # 101 without one, 20 listed


@pytest.mark.slow  # a real slot worker's time slice: ~5 s
def test_slots_that_move_between_workers_are_one_tile_and_lost_only_when_a_worker_dies(
    ada_client, settings, live_work_keys_cleared
):
    """A run's two sim slots through a time-slice hand-over (a real `serve_slice` ends its
    slice), the next worker taking the slot, and a worker killed: the wall keeps one tile
    per slot and says `lost` only for the dead worker's slot; the host map counts the two
    slots the run has and says `down` only when that host's last worker is gone."""
    from datetime import timedelta

    from django.utils import timezone

    from datamanager.models import SlotStatus, Task
    from datamanager.selectors.env_health import host_map
    from datamanager.services import env_slots
    from tests.datamanager.factories import make_running_run
    from workers import slot_worker

    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    Task.objects.create(name="sim/one", env_kind="sim", env_config={"targets": 1})
    run = make_running_run({"policy": "oracle", "tasks": {"env_kinds": ["sim"]},
                            "env": {"miniwob_slots": 0, "sim_slots": 2}})  # fmt: skip
    outcome = slot_worker.serve_slice(run_id=run.pk, backend="sim", index=0, max_seconds=1.0)
    assert outcome.reason == "time slice over"
    first = EnvSlot.objects.get(run=run, key="sim:0")
    assert first.status == SlotStatus.RELEASED

    def wall() -> dict[str, str]:
        tiles = ada_client.get(f"/runs/{run.pk}/slots.json").json()["slots"]
        return {t["name"].removeprefix(f"{host}:"): t["status"] for t in tiles}

    host = first.host
    pid = first.name.split(":")[1]
    silent = timezone.now() - timedelta(seconds=run_silent_after(run) + 5)
    EnvSlot.objects.filter(pk=first.pk).update(last_heartbeat=silent)  # long ago: no worker
    assert wall() == {f"{pid}:sim:0": "released"}  # waiting for a worker, not lost
    assert [(h.host, h.state, sum(h.slots.values())) for h in host_map(run=run)] == [
        (host, "waiting", 1)
    ]
    # The next worker takes slot 0 (its own row), another serves slot 1.
    for name in (f"{host}:9001:sim:0", f"{host}:9002:sim:1"):
        slot = env_slots.env_slot_register(name=name, host=host, backend="sim", run_id=run.pk)
        env_slots.env_slot_set(slot_id=slot.pk, status=SlotStatus.BUSY)
    assert wall() == {"9001:sim:0": "busy", "9002:sim:1": "busy"}
    assert [(h.state, h.slots) for h in host_map(run=run)] == [("ok", {"busy": 2})]
    # Slot 1's worker is killed: its tile is lost, the host still serves slot 0.
    EnvSlot.objects.filter(name=f"{host}:9002:sim:1").update(last_heartbeat=silent)
    assert wall() == {"9001:sim:0": "busy", "9002:sim:1": "lost"}
    assert [(h.state, h.slots) for h in host_map(run=run)] == [("ok", {"busy": 1, "lost": 1})]
    EnvSlot.objects.filter(name=f"{host}:9001:sim:0").update(last_heartbeat=silent)
    assert [h.state for h in host_map(run=run)] == ["down"]


def test_the_evaluation_slot_hands_over_between_episodes_and_the_others_keep_training(
    ada_client, settings, live_work_keys_cleared
):
    """With a third of three slots for evaluation, slot 0 hands over to a queued evaluation
    shard at once (not at the end of its 5-minute slice) and says so; slot 1 keeps running
    episodes. The workers line says what the queued slot waits behind."""
    from datamanager.live_work import eval_shard_work, redis_client, slot_work
    from datamanager.models import EvalJob, SlotStatus, Task
    from tests.datamanager.factories import make_running_run
    from workers import slot_worker

    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    Task.objects.create(name="sim/one", env_kind="sim", env_config={"targets": 1})
    run = make_running_run({"policy": "oracle", "tasks": {"env_kinds": ["sim"]},
                            "env": {"miniwob_slots": 0, "sim_slots": 3},
                            "evaluation": {"slot_share": 1 / 3}})  # fmt: skip
    job = EvalJob.objects.create(name="e", policy="oracle", run=run, policy_version=8,
                                 scope="train_instances", task_names=["sim/one"], k=4,
                                 shards=1, status="running")  # fmt: skip
    client = redis_client()
    try:
        client.set(eval_shard_work(job_id=job.pk, shard=0, shards=1).pending_key, "0")
    finally:
        client.close()
    outcome = slot_worker.serve_slice(run_id=run.pk, backend="sim", index=0, max_seconds=5)
    assert outcome == slot_worker.SlotOutcome(
        True, f"handed over to evaluation #{job.pk} shard 1/1"
    )
    assert EnvSlot.objects.get(run=run, key="sim:0").status == SlotStatus.RELEASED
    assert not Trajectory.objects.filter(run=run, purpose="train").exists()
    outcome = slot_worker.serve_slice(run_id=run.pk, backend="sim", index=1, max_seconds=1.0)
    assert outcome.reason == "time slice over"
    assert Trajectory.objects.filter(run=run, purpose="train").exists()
    client = redis_client()
    try:  # slot 0's task back in the queue, as workers.tasks.slot_serve re-enqueues it
        client.set(slot_work(run_id=run.pk, backend="sim", index=0).pending_key, "0")
    finally:
        client.close()
    html = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert "queued on env behind the evaluation of v8" in html


def run_silent_after(run: Run) -> float:

    return run.cfg.env.silent_after_s
