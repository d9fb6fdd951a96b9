"""The runs watchdog brings back live work whose worker died, and only that (real Redis).

The end-to-end version, with real worker processes killed by SIGKILL, is
tests/dartboard/test_fault_tolerance.py."""

import base64
import json

import pytest

from datamanager.live_work import redis_client, slot_work, trainer_work, work_enqueue
from datamanager.models import Run
from tests.datamanager.factories import make_running_run, make_tasks
from tests.helpers import redis_commands_counted
from workers.watchdog import watchdog_pass

pytestmark = pytest.mark.django_db


@pytest.fixture
def redis(settings, live_work_keys_cleared):
    """The suite's Redis, with no lease, watchdog marker or queued message left from earlier
    runs: a Redis server outlives the test database, and run ids repeat across tests, so an
    earlier test's message for "run 8, slot 0" would read as this test's work still queued.
    No worker consumes this xdist worker's queues while a watchdog test runs."""
    settings.DARTBOARD_WATCHDOG_GRACE_S = 5.0
    client = redis_client()
    client.delete("env", "train")
    yield client
    client.delete("env", "train")
    client.close()  # the leases it faked go with live_work_keys_cleared


def _queued_tasks(client, queue: str) -> list[tuple[str, list]]:
    """(task name, args) of the Celery messages waiting in `queue`."""
    out = []
    for raw in client.lrange(queue, 0, -1):
        message = json.loads(raw)
        args = json.loads(base64.b64decode(message["body"]))[0]
        out.append((message["headers"]["task"], args))
    return out


def test_a_dead_trainer_is_enqueued_again_once_its_lease_has_lapsed_for_the_grace(redis):
    make_tasks(1)
    run = make_running_run({"env": {"miniwob_slots": 1}})
    # The slot's worker is alive (it holds the lease); the trainer's worker died (no lease,
    # nothing pending in a queue).
    redis.set(slot_work(run_id=run.pk, backend="miniwob", index=0).lease_key, "h:1:x", ex=60)
    trainer_before = redis.llen("train")

    assert watchdog_pass(now=1000.0) == []  # first seen missing
    assert watchdog_pass(now=1004.0) == []  # not yet missing for the 5 s grace
    assert watchdog_pass(now=1006.0) == [f"run {run.pk}: trainer"]

    assert redis.llen("train") == trainer_before + 1
    assert ("workers.tasks.train_run", [run.pk]) in _queued_tasks(redis, "train")
    run.refresh_from_db()
    assert run.status_message.startswith("watchdog: the trainer had no live worker for 5 s")
    # The slot was never touched, and the re-enqueued trainer, waiting in its queue, is
    # not enqueued a second time however long it waits.
    assert watchdog_pass(now=1100.0) == []
    assert watchdog_pass(now=2000.0) == []
    assert redis.llen("train") == trainer_before + 1


def test_work_waiting_in_a_queue_or_of_a_stopped_run_is_left_alone(redis):
    make_tasks(1)
    waiting = make_running_run({"env": {"miniwob_slots": 1}})
    stopped = make_running_run({"env": {"miniwob_slots": 1}})
    Run.objects.filter(pk=stopped.pk).update(status="stopped")
    # `waiting`'s slot task and trainer are queued behind other work: no lease, but pending.
    work_enqueue(slot_work(run_id=waiting.pk, backend="miniwob", index=0))
    work_enqueue(trainer_work(run_id=waiting.pk, mode="decoupled"))
    for now in (1000.0, 1010.0, 1100.0):
        assert watchdog_pass(now=now) == []


def test_a_trainer_that_reached_max_updates_is_not_restarted(redis):
    from datamanager.models import TrainUpdate

    make_tasks(1)
    run = make_running_run(
        {"env": {"miniwob_slots": 0, "desktop_slots": 1}, "trainer": {"max_updates": 1}}
    )
    TrainUpdate.objects.create(run=run, number=1, policy_version=0)
    redis.set(slot_work(run_id=run.pk, backend="desktop", index=0).lease_key, "h:1:x", ex=60)
    for now in (1000.0, 1010.0, 1020.0):
        assert watchdog_pass(now=now) == []


@pytest.mark.slow  # the duplicate waits the lease's TTL + 5 s for a lapse: ~6 s
def test_a_second_trainer_task_finds_the_lease_held_and_ends(redis, settings):
    from workers import tasks

    settings.DARTBOARD_LEASE_TTL_S = 1.0  # the duplicate waits TTL + 5 s for a lapse
    make_tasks(1)
    run = make_running_run({"trainer": {"kl_coef": 0.0}})
    redis.set(trainer_work(run_id=run.pk, mode="decoupled").lease_key, "other:7:trainer", ex=60)
    queued = redis.llen("train")

    assert tasks.train_run(run.pk) == f"the trainer of run {run.pk} is held by other:7:trainer"
    assert redis.llen("train") == queued  # and it did not re-enqueue itself


def test_a_lost_evaluation_shard_is_enqueued_again_and_a_finished_one_is_not(redis):
    """A scheduled evaluation's shard whose worker died (no lease, nothing queued) comes back;
    a shard whose episodes all ended, or one whose worker is alive, is left alone."""
    from datamanager.live_work import eval_shard_work
    from datamanager.models import EvalJob, Task, Trajectory
    from datamanager.services.evaluations import eval_job_create, eval_job_start

    make_tasks(1)
    run = make_running_run({"env": {"miniwob_slots": 1}})
    for name in ("eval-a", "eval-b", "eval-c"):
        Task.objects.create(name=name, env_kind="miniwob", split="eval")
    job = eval_job_create(
        name="v1", policy="oracle", tasks=list(Task.objects.filter(split="eval")), k=1,
        run_id=run.pk, policy_version=1, shards=3,
    )  # fmt: skip
    eval_job_start(job_id=job.pk)
    # Shard 0 (eval-a) has finished its episode; shard 1's worker is alive; shard 2's died.
    Trajectory.objects.create(
        task=Task.objects.get(name="eval-a"), eval_job=job, purpose="eval", status="succeeded"
    )
    redis.set(eval_shard_work(job_id=job.pk, shard=1, shards=3).lease_key, "h:2:x", ex=60)
    for work in (
        slot_work(run_id=run.pk, backend="miniwob", index=0),
        trainer_work(run_id=run.pk, mode="decoupled"),
    ):
        redis.set(work.lease_key, "h:1:x", ex=60)
    env_before = redis.llen("env")

    assert watchdog_pass(now=2000.0) == []
    assert watchdog_pass(now=2006.0) == [f"evaluation #{job.pk} shard 3/3"]
    assert ("workers.tasks.eval_shard", [job.pk, 2, 3]) in _queued_tasks(redis, "env")
    assert redis.llen("env") == env_before + 1
    run.refresh_from_db()
    assert run.status_message.startswith(f"watchdog: evaluation #{job.pk} shard 3/3 had no")
    assert watchdog_pass(now=2100.0) == []  # queued now: not enqueued twice
    EvalJob.objects.filter(pk=job.pk).update(status="finished")
    redis.delete(eval_shard_work(job_id=job.pk, shard=2, shards=3).pending_key)
    assert watchdog_pass(now=2200.0) == [] and watchdog_pass(now=2300.0) == []  # done jobs


def test_an_evaluation_whose_last_episode_was_cut_is_finished_and_the_next_one_scheduled(redis):
    """A worker killed in the last episode of a scheduled evaluation: the watchdog ends that
    episode `aborted`, and then no shard comes back to write the report (a resumed shard
    skips ended episodes). The watchdog finishes the job, so the run's next evaluation (one
    at a time) is scheduled instead of waiting behind it for ever. Not while its shard is
    alive, however long the episode has run."""
    from datetime import timedelta

    from django.utils import timezone

    from datamanager.live_work import eval_shard_work
    from datamanager.models import EvalJob, PolicyVersion, Trajectory
    from datamanager.services.evaluations import eval_schedule_next

    tasks = make_tasks(2)
    run = make_running_run(
        {"env": {"miniwob_slots": 1},
         "evaluation": {"every_n_versions": 1, "eval_split": False, "heldout_k": 1}}
    )  # fmt: skip
    (job,) = eval_schedule_next(run_id=run.pk)
    EvalJob.objects.filter(pk=job.pk).update(status="running")
    Trajectory.objects.create(task=tasks[0], run=run, eval_job=job, purpose="eval",
                              seed=job.seed * 1000, status="succeeded")  # fmt: skip
    cut = Trajectory.objects.create(task=tasks[1], run=run, eval_job=job, purpose="eval",
                                    seed=job.seed * 1000)  # fmt: skip
    Trajectory.objects.filter(pk=cut.pk).update(started_at=timezone.now() - timedelta(minutes=5))
    PolicyVersion.objects.create(run=run, version=1, checkpoint="/ckpt/v1")
    lease = eval_shard_work(job_id=job.pk, shard=0, shards=job.shards).lease_key
    redis.set(lease, "h:3:evaluation", ex=60)  # its shard is alive: it writes the report

    assert watchdog_pass(now=3000.0) == []
    # Five minutes old, but its shard is alive: an evaluation episode may run that long.
    assert Trajectory.objects.get(pk=cut.pk).status == "running"
    assert EvalJob.objects.get(pk=job.pk).status == "running"

    redis.delete(lease)  # its worker was killed
    assert watchdog_pass(now=3001.0) == [f"evaluation #{job.pk} finished"]
    assert Trajectory.objects.get(pk=cut.pk).status == "aborted"
    job.refresh_from_db()
    assert (job.status, job.done, job.total) == ("finished", 2, 2)
    following = EvalJob.objects.exclude(pk=job.pk).get(run=run)
    assert (following.policy_version, following.status) == (1, "queued")
    run.refresh_from_db()
    assert run.status_message.startswith(f"watchdog: evaluation #{job.pk} finished")


def test_a_pending_marker_whose_message_left_the_queue_is_lost_work(redis):
    """A Redis outage can strand a task: its pending marker survives, but its message was
    lost with the queue (a restart without the data) or taken by a consumer whose connection
    died. The watchdog brings that work back; a message still in the queue, or one sent
    with a countdown that has not run out, is left alone."""
    import time

    make_tasks(1)
    run = make_running_run({"env": {"miniwob_slots": 2}})
    stranded = slot_work(run_id=run.pk, backend="miniwob", index=0)
    waiting = slot_work(run_id=run.pk, backend="miniwob", index=1)
    trainer = trainer_work(run_id=run.pk, mode="decoupled")
    env_before = redis.llen("env")
    work_enqueue(stranded)
    stranded_message = redis.lindex("env", 0)  # kombu pushes on the left
    work_enqueue(waiting)
    work_enqueue(trainer, countdown=600)  # a retry due in 10 minutes
    # The stranded message leaves the queue (as a consumer's fetch moves it to `unacked`).
    redis.lrem("env", 1, stranded_message)
    redis.lpop("train")  # the countdown task waits with a worker, not in the queue

    now = time.time() + 30  # past the grace of a fresh marker
    assert watchdog_pass(now=now) == []
    assert watchdog_pass(now=now + 6) == [f"run {run.pk}: slot miniwob:0"]
    assert ("workers.tasks.slot_serve", [run.pk, "miniwob", 0]) in _queued_tasks(redis, "env")
    assert redis.llen("env") == env_before + 2  # the waiting one, and the lost one again
    assert watchdog_pass(now=now + 20) == []  # now queued: not enqueued twice


def test_a_slot_silent_only_in_the_database_keeps_its_episode(redis):
    """A database outage stops every heartbeat for its length; a slot whose worker kept its
    Redis lease is alive, and its episode must not be ended as an orphan. A slot with
    neither heartbeat nor lease is."""
    from datetime import timedelta

    from django.utils import timezone

    from datamanager.models import EnvSlot, Trajectory
    from datamanager.services import episodes

    make_tasks(1)
    run = make_running_run({"env": {"miniwob_slots": 1}})
    slot = EnvSlot.objects.create(
        name="host:7:miniwob:0", host="host", backend="miniwob", run=run,
        last_heartbeat=timezone.now() - timedelta(seconds=120),
    )  # fmt: skip
    claim = episodes.task_claim(run_id=run.pk, slot_id=slot.pk, env_kinds=("miniwob",))
    assert claim is not None
    lease = slot_work(run_id=run.pk, backend="miniwob", index=0).lease_key
    redis.set(lease, "host:7:miniwob:0", ex=60)

    watchdog_pass(now=1000.0)
    assert Trajectory.objects.get(pk=claim.trajectory_id).status == "running"

    redis.delete(lease)  # the worker is gone: no lease either
    watchdog_pass(now=1010.0)
    ended = Trajectory.objects.get(pk=claim.trajectory_id)
    assert ended.status == "aborted" and "env worker stopped" in ended.error


def test_a_pass_over_500_live_slots_costs_a_few_redis_round_trips(redis, monkeypatch):
    """Leases are read in pipelines: one round trip a slot made a pass over 1,000 slots
    take seconds of Redis round trips (bench/scale.py)."""
    make_tasks(1)
    run = make_running_run({"policy": "oracle", "env": {"miniwob_slots": 0, "sim_slots": 500}})
    pipe = redis.pipeline()
    for i in range(500):
        pipe.set(slot_work(run_id=run.pk, backend="sim", index=i).lease_key, f"h:1:sim:{i}", ex=60)
    pipe.execute()
    sends = redis_commands_counted(monkeypatch)
    assert watchdog_pass(now=1000.0) == []
    assert len(sends) <= 20  # 11 here; one a slot was over 1,000
