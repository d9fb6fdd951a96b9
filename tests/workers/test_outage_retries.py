"""Database and object-storage outages in the step-record path: a locked or restarting
database, or an S3 server restarting, is waited out with bounded backoff, a retried step is
stored once and whole, and past the budget the episode ends `error` with the reason and its
recorded steps intact. Real SQLite or PostgreSQL (whichever the suite runs on), locked by a
second connection; a real S3 API (moto's server) stopped and started."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator

import pytest
from botocore.exceptions import ClientError
from django.db import connection

from core.artifacts import s3_client_config, s3_transfer_config
from core.steps import StepRecord
from datamanager.config import RunConfig
from datamanager.models import EvalStatus, Step, Task, Trajectory, TrajectoryStatus
from datamanager.services import env_slots, episodes, evaluations, steps
from envmanager.oracle_policy import OracleEndpoint
from tests.conftest import png_bytes
from tests.datamanager import factories
from tests.datamanager.factories import make_running_run, make_tasks
from tests.helpers import needs
from tests.private_services import PrivateS3
from workers import slot_worker
from workers.dbutil import DatabaseUnavailable, StorageUnavailable, db_retry
from workers.env_cache import TaskEnv, process_env
from workers.episode_runner import DbRecorder, EpisodeEnd, episode_run, trajectory_end
from workers.evaluation import _episode_config, eval_job_run

pytestmark = pytest.mark.django_db(transaction=True)


@contextlib.contextmanager
def _short_lock_wait() -> Iterator[None]:
    """This process gives up on a held lock after 0.3 s (instead of SQLite's 30 s busy
    timeout), so the retry loop, not the driver, does the waiting."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    saved = dict(options)
    if connection.vendor == "sqlite":
        options["timeout"] = 0.3
    else:
        options["options"] = "-c lock_timeout=300"
    connection.close()
    try:
        yield
    finally:
        options.clear()
        options.update(saved)
        connection.close()


def _hold_write_lock(seconds: float, release: threading.Event | None = None) -> threading.Event:
    """Another connection takes the steps table's write lock for `seconds` (in a thread),
    or until `release` is set; the returned event is set once the lock is held."""
    held = threading.Event()
    settings_dict = connection.settings_dict

    def hold() -> None:
        if connection.vendor == "sqlite":
            other = sqlite3.connect(settings_dict["NAME"], timeout=5, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")
            held.set()
            (release or threading.Event()).wait(seconds)
            other.execute("COMMIT")
            other.close()
            return
        import psycopg

        with psycopg.connect(
            host=settings_dict["HOST"] or "127.0.0.1",
            port=settings_dict["PORT"] or 5432,
            user=settings_dict["USER"],
            password=settings_dict["PASSWORD"] or None,
            dbname=settings_dict["NAME"],
        ) as other:
            other.execute(
                "LOCK TABLE datamanager_step, datamanager_trajectory IN ACCESS EXCLUSIVE MODE"
            )
            held.set()
            (release or threading.Event()).wait(seconds)

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(10), "the second connection never got the lock"
    return held


def _record(index: int) -> StepRecord:
    return StepRecord(
        index=index,
        screenshot_png=png_bytes(color=(index * 30, 80, 160)),
        width=160,
        height=210,
        raw_output="Thought: t\nAction: click(start_box='(10,20)')",
        thought="t",
        action={"type": "click", "x": 10, "y": 20},
        parse_error="",
        prompt_tokens=50,
        response_tokens=9,
        rollout_logprobs=[-0.5] * 9,
        response_token_ids=list(range(9)),
        mean_entropy=0.4,
        policy_version=0,
        env_ms=1.0,
        model_ms=2.0,
    )


def _claim() -> int:
    make_tasks(1)
    run = make_running_run({"env": {"miniwob_slots": 1}})
    claim = episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
    assert claim is not None
    return claim.trajectory_id


def test_a_locked_database_is_waited_out_and_the_step_is_written_once(settings):
    settings.DARTBOARD_DB_RETRY_S = 30.0
    trajectory_id = _claim()
    recorder = DbRecorder(trajectory_id)
    recorder.set_instruction("click")
    with _short_lock_wait():
        _hold_write_lock(2.0)
        started = time.monotonic()
        recorder.record_step(_record(0))
        waited = time.monotonic() - started
    assert waited >= 1.0  # it really met the lock, and waited it out
    steps = Step.objects.filter(trajectory_id=trajectory_id)
    assert steps.count() == 1 and steps.get().screenshot.read().startswith(b"\x89PNG")
    assert Trajectory.objects.get(pk=trajectory_id).length == 1


def test_past_the_budget_the_episode_ends_error_with_its_steps_intact(settings):
    settings.DARTBOARD_DB_RETRY_S = 1.0
    trajectory_id = _claim()
    recorder = DbRecorder(trajectory_id)
    recorder.set_instruction("click")
    recorder.record_step(_record(0))
    with _short_lock_wait():
        _hold_write_lock(4.0)
        with pytest.raises(DatabaseUnavailable) as failure:
            recorder.record_step(_record(1))
    message = str(failure.value)
    assert f"recording step 1 of trajectory {trajectory_id}" in message
    assert "last error: OperationalError" in message
    settings.DARTBOARD_DB_RETRY_S = 30.0  # the lock is gone once its holder finishes
    trajectory_end(trajectory_id, status="error", reward=None, error=f"database: {failure.value}")
    trajectory = Trajectory.objects.get(pk=trajectory_id)
    assert trajectory.status == "error" and "recording step 1" in trajectory.error
    assert list(trajectory.steps.values_list("index", flat=True)) == [0]
    assert trajectory.length == 1


def test_a_retried_step_is_stored_once_and_whole():
    """The retry of a step whose row was written (the trajectory's length was not), and of
    one whose screenshot file was written without its row."""
    trajectory_id = _claim()
    head = steps.trajectory_head(trajectory_id=trajectory_id)
    fields = {k: v for k, v in vars(_record(0)).items() if k != "index"}
    first = factories.step_record(trajectory_id=trajectory_id, index=0, head=head, **fields)
    again = factories.step_record(
        trajectory_id=trajectory_id, index=0, head=head, resume=True, **fields
    )
    assert again.pk == first.pk and Step.objects.filter(trajectory_id=trajectory_id).count() == 1

    # Step 1: its file was stored, then the database went away before the row.
    orphan = Step(trajectory_id=trajectory_id, index=1)
    name = f"run-{head.run_id}/traj-{trajectory_id}/001.png"
    orphan.screenshot.save(name, _content(b"half"), save=False)
    stored = factories.step_record(
        trajectory_id=trajectory_id, index=1, head=head, resume=True, **fields
    )
    assert stored.screenshot.name == orphan.screenshot.name  # the same file, not a copy
    assert stored.screenshot.read().startswith(b"\x89PNG")
    assert Trajectory.objects.get(pk=trajectory_id).length == 2


def _content(data: bytes):
    from django.core.files.base import ContentFile

    return ContentFile(data)


def test_only_transient_errors_are_retried():
    """A constraint or a missing table is a bug, raised at once, never waited on."""
    from django.db import IntegrityError

    calls = []

    def broken(attempt: int) -> None:
        calls.append(attempt)
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table_here")

    started = time.monotonic()
    with pytest.raises(Exception) as failure:
        db_retry(broken, what="reading nothing", budget_s=30)
    assert calls == [0] and time.monotonic() - started < 5
    assert not isinstance(failure.value, (DatabaseUnavailable, IntegrityError))


@pytest.fixture
@needs("live")  # a moto S3 server of its own, stopped and restarted
def s3_screenshots(settings, monkeypatch) -> Iterator[PrivateS3]:
    """Screenshots go to a private S3 server of this test's own (which it stops and starts)."""
    server = PrivateS3(buckets=("shots",))  # the bucket is there before the server answers
    server.start()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {"bucket_name": "shots", "endpoint_url": server.url,
                        "client_config": s3_client_config(),
                        "transfer_config": s3_transfer_config()},
        },
    }  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def test_an_object_storage_restart_is_waited_out_and_the_step_is_stored(settings, s3_screenshots):
    settings.DARTBOARD_DB_RETRY_S = 60.0
    trajectory_id = _claim()
    recorder = DbRecorder(trajectory_id)
    recorder.set_instruction("click")
    recorder.record_step(_record(0))
    s3_screenshots.stop()
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            recorder.record_step(_record(1))
            done.set()
        except BaseException as exc:  # shown by the assertion below, not lost in the thread
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(3)
    assert not done.is_set() and not errors  # it is waiting for the store, not failing
    s3_screenshots.start()  # a new store on the same address, its bucket made before it answers
    writer.join(60)
    assert done.is_set(), errors
    steps = Step.objects.filter(trajectory_id=trajectory_id).order_by("index")
    assert [s.index for s in steps] == [0, 1]
    assert steps[1].screenshot.read().startswith(b"\x89PNG")


def test_past_the_budget_an_object_storage_outage_is_named(settings, s3_screenshots):
    settings.DARTBOARD_DB_RETRY_S = 2.0
    trajectory_id = _claim()
    recorder = DbRecorder(trajectory_id)
    recorder.set_instruction("click")
    s3_screenshots.stop()
    with pytest.raises(StorageUnavailable) as failure:
        recorder.record_step(_record(0))
    message = str(failure.value)
    assert message.startswith("object storage was unreachable for 2 s while recording step 0")
    assert "EndpointConnectionError" in message
    assert not Step.objects.filter(trajectory_id=trajectory_id).exists()


def test_a_missing_bucket_is_not_an_outage(settings, s3_screenshots):
    settings.DARTBOARD_DB_RETRY_S = 30.0
    trajectory_id = _claim()
    recorder = DbRecorder(trajectory_id)
    recorder.set_instruction("click")
    s3_screenshots.client().delete_bucket(Bucket="shots")
    started = time.monotonic()
    with pytest.raises(ClientError, match="NoSuchBucket"):
        recorder.record_step(_record(0))
    assert time.monotonic() - started < 10  # raised at once, not retried for 30 s


def test_a_bucket_that_is_gone_ends_the_episode_as_storage_not_the_environment(
    settings, s3_screenshots
):
    """A permanent storage error (the bucket deleted): the episode ends `storage: ...` at
    once, the slot is not counted as failing, and its environment is kept."""
    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0  # the sim backend without its OSWorld waits
    Task.objects.create(name="sim/click-2", env_kind="sim", env_config={"targets": 2})
    run = make_running_run({"policy": "oracle", "tasks": {"env_kinds": ["sim"]},
                            "env": {"miniwob_slots": 0, "sim_slots": 1}})  # fmt: skip
    slot = env_slots.env_slot_register(name="t:1:sim:0", host="t", backend="sim", run_id=run.pk)
    claim = episodes.task_claim(run_id=run.pk, slot_id=slot.pk, env_kinds=("sim",))
    assert claim is not None
    s3_screenshots.client().delete_bucket(Bucket="shots")
    env = process_env("sim")
    cfg = run.cfg
    assert slot_worker._run_claim(claim, slot.pk, "sim", cfg, client=None) is False
    traj = Trajectory.objects.get(pk=claim.trajectory_id)
    assert traj.status == "error" and traj.error.startswith("storage: NoSuchBucket")
    assert "NoSuchBucket" in traj.error
    slot.refresh_from_db()
    assert slot.consecutive_failures == 0 and slot.status == "idle"
    assert process_env("sim") is env  # the environment was fine: kept


@pytest.mark.parametrize(
    ("outage", "reason"),
    [("stopped", "storage: object storage was unreachable for 1 s while recording step 0"),
     ("bucket gone", "storage: NoSuchBucket")],
)  # fmt: skip
def test_an_evaluation_rides_out_a_storage_failure_as_a_slot_does(
    settings, s3_screenshots, outage, reason
):
    """Evaluation episodes go through the slots' runner: storage that stays away (or refuses
    for good) ends each episode `storage: ...`, keeps the environment, and the job goes on."""
    settings.DARTBOARD_DB_RETRY_S = 1.0
    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0  # the sim backend without its OSWorld waits
    task = Task.objects.create(name="sim/click-2", env_kind="sim", env_config={"targets": 2})
    job = evaluations.eval_job_create(name="no screenshots", policy="oracle", tasks=[task], k=2)
    if outage == "stopped":
        s3_screenshots.stop()
    else:
        s3_screenshots.client().delete_bucket(Bucket="shots")
    envs = []  # the cached env after each episode: one and the same when it is kept
    job = eval_job_run(job_id=job.pk, on_episode=lambda: envs.append(process_env("sim")))
    assert job.status == EvalStatus.FINISHED and job.done == 2
    trajs = Trajectory.objects.filter(eval_job=job)
    assert [t.status for t in trajs] == [TrajectoryStatus.ERROR] * 2
    assert all(t.error.startswith(reason) for t in trajs), [t.error for t in trajs]
    assert len(envs) == 2 and envs[0] is envs[1]


def test_a_database_outage_ends_an_evaluation_episode_with_its_env_kept(settings):
    """The database away past the budget while an evaluation episode starts: the episode
    ends `database: ...` once it is back, and the environment is kept."""
    settings.DARTBOARD_DB_RETRY_S = 1.0
    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    task = Task.objects.create(name="sim/click-2", env_kind="sim", env_config={"targets": 2})
    job = evaluations.eval_job_create(name="locked", policy="oracle", tasks=[task], k=1)
    config = _episode_config(job, seed=0)
    traj = evaluations.eval_trajectory_start(job=job, task=task, seed=0, step_cap=2)
    oracle = OracleEndpoint(geometry=config.image_geometry)
    env = process_env("sim")
    with _short_lock_wait():
        release = threading.Event()
        _hold_write_lock(30.0, release=release)
        outcome = episode_run(
            trajectory_id=traj.pk,
            task=task.spec(0),
            env=TaskEnv(
                backend="sim", env_config=task.env_config, env=RunConfig().env, oracle=oracle
            ),
            policy=oracle,
            recorder=_Releasing(DbRecorder(traj.pk), release),
            config=config,
        )
    assert outcome.end is EpisodeEnd.OUTAGE and not outcome.env_failed
    traj.refresh_from_db()
    assert traj.status == TrajectoryStatus.ERROR
    assert traj.error.startswith(f"database: the database was unreachable for 1 s while "
                                 f"starting trajectory {traj.pk}")  # fmt: skip
    assert process_env("sim") is env  # kept


class _Releasing:
    """A DbRecorder that lets the database back (sets `release`) once its first write gave
    up: the trajectory's end then finds it answering."""

    def __init__(self, inner: DbRecorder, release: threading.Event) -> None:
        self.inner, self.release = inner, release

    def set_instruction(self, instruction: str) -> None:
        try:
            self.inner.set_instruction(instruction)
        finally:
            self.release.set()

    def record_step(self, record: StepRecord) -> None:
        self.inner.record_step(record)


@pytest.mark.slow  # an episode on the sim backend
def test_a_full_disk_under_the_screenshots_ends_the_episode_and_pauses_the_run(
    settings, small_disk
):
    """A step's screenshot finds no space left: the episode ends `disk full: ...` (the slot
    not counted as failing, its environment kept), and the run pauses saying where."""
    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    settings.MEDIA_ROOT = small_disk
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(small_disk)}}}  # fmt: skip
    with contextlib.suppress(OSError), (small_disk / "filler").open("wb") as filler:
        while True:  # until the filesystem is full
            filler.write(b"\0" * 65536)
            filler.flush()
    Task.objects.create(name="sim/click-2", env_kind="sim", env_config={"targets": 2})
    run = make_running_run({"policy": "oracle", "tasks": {"env_kinds": ["sim"]},
                            "env": {"miniwob_slots": 0, "sim_slots": 1}})  # fmt: skip
    slot = env_slots.env_slot_register(name="t:1:sim:0", host="t", backend="sim", run_id=run.pk)
    claim = episodes.task_claim(run_id=run.pk, slot_id=slot.pk, env_kinds=("sim",))
    assert claim is not None
    env = process_env("sim")
    slot_worker._run_claim(claim, slot.pk, "sim", run.cfg, client=None)
    traj = Trajectory.objects.get(pk=claim.trajectory_id)
    assert traj.status == "error" and traj.error.startswith("disk full: [Errno 28] No space left")
    run.refresh_from_db()
    assert (run.status, run.paused_for_disk) == ("paused", True)
    assert run.status_message.startswith(f"paused: no space left on device writing a step of "
                                         f"trajectory {traj.pk}")  # fmt: skip
    slot.refresh_from_db()
    assert slot.consecutive_failures == 0
    assert process_env("sim") is env  # the environment was fine: kept
