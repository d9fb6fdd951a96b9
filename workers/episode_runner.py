"""The episode runner: one episode of a trajectory already started, recorded step by step,
and the trajectory's end, whatever happened. Env slots (workers.slot_worker), evaluation
shards (workers.evaluation) and bench/scale_slots.py run every episode through
`episode_run`, so an error ends a trajectory the same way wherever it ran.

How an episode ends (`EpisodeEnd`) and what its trajectory says:
- ran to its end: succeeded / failed with its reward;
- the slot was taken over (`SlotTakenOver`): aborted;
- the database or the object storage stayed away past the retry budget (workers/dbutil.py):
  error "database: ..." / "storage: ...", the steps recorded so far intact, the env kept;
- the object storage refused a screenshot for good (a missing bucket): error "storage: ...",
  the env kept;
- a write found no space left (a full disk): error "disk full: ...", the env kept, and the
  run paused until there is room (workers/disk.py);
- the policy did not answer (`InferenceError`): error "inference: ...", the env kept;
- anything else came from the environment: error with the exception (and its traceback,
  unless it is an `EnvUnavailable`), the env discarded so the next episode gets a fresh one.
The caller decides what that means for its slot or its job.
"""

from __future__ import annotations

import enum
import logging
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from core.protocol import Env, EnvUnavailable, TaskSpec
from core.steps import StepRecord
from datamanager.models import Trajectory, TrajectoryStatus
from datamanager.services import episodes
from datamanager.services.steps import StepWrite, TrajectoryHead, steps_store, trajectory_head
from rollout.client import InferenceError
from rollout.episode import EpisodeConfig, Pacer, PolicyEndpoint, Recorder, play_episode
from workers.dbutil import DatabaseUnavailable, StorageUnavailable, db_retry
from workers.disk import is_disk_full, run_pause_for_disk

log = logging.getLogger("dartboard.episodes")

T = TypeVar("T")


class SlotTakenOver(RuntimeError):
    """Another worker holds this slot's lease now (this one lost it during an outage)."""


class DbRecorder:
    """Records an episode's steps through the data manager's services, retrying while the
    database is away. With a `lost` event (the slot's lease went to another worker) it
    refuses to record more."""

    def __init__(self, trajectory_id: int, lost: threading.Event | None = None) -> None:
        self.trajectory_id = trajectory_id
        self.head: TrajectoryHead | None = None
        self.lost = lost

    def _check_lease(self) -> None:
        if self.lost is not None and self.lost.is_set():
            raise SlotTakenOver("another worker took this slot's lease during an outage")

    def set_instruction(self, instruction: str) -> None:
        self._check_lease()

        def write(attempt: int) -> None:
            episodes.trajectory_set_instruction(
                trajectory_id=self.trajectory_id, instruction=instruction
            )
            self.head = trajectory_head(trajectory_id=self.trajectory_id)

        db_retry(write, what=f"starting trajectory {self.trajectory_id}")

    def record_step(self, record: StepRecord) -> None:
        self._check_lease()
        db_retry(
            lambda attempt: self._write_step(record, resume=attempt > 0),
            what=f"recording step {record.index} of trajectory {self.trajectory_id}",
        )

    def _write_step(self, record: StepRecord, *, resume: bool) -> None:
        if self.head is None:
            self.head = trajectory_head(trajectory_id=self.trajectory_id)
        steps_store(writes=[StepWrite(head=self.head, record=record)], resume=resume)


def trajectory_end(trajectory_id: int, **fields: Any) -> None:
    """End a trajectory, retrying while the database is away (finishing twice is a no-op)."""
    db_retry(
        lambda _: episodes.trajectory_finish(trajectory_id=trajectory_id, **fields),
        what=f"ending trajectory {trajectory_id}",
    )


class EnvSource(Protocol):
    """Where an episode's env comes from (workers.env_cache.TaskEnv): `open` runs inside the
    runner's error handling, `discard` after the env failed."""

    def open(self) -> Env: ...

    def discard(self) -> None: ...


class EpisodeEnd(enum.Enum):
    RAN = "ran"  # to its end: succeeded or failed
    TAKEN_OVER = "taken over"  # another worker holds the slot
    OUTAGE = "outage"  # the database or the object storage away past the retry budget
    STORAGE = "storage"  # the object storage refused for good
    INFERENCE = "inference"  # the policy did not answer
    ENV = "env"  # the environment (or its driver) failed


@dataclass(frozen=True)
class EpisodeOutcome:
    end: EpisodeEnd
    status: TrajectoryStatus  # what its trajectory ended as
    reason: str = ""  # the trajectory's error ("" for an episode that ran to its end)
    error: Exception | None = None  # what ended it early

    @property
    def env_failed(self) -> bool:
        """The env was at fault: it was discarded (a slot counts it towards quarantine)."""
        return self.end is EpisodeEnd.ENV


def _here(call: Callable[[], T]) -> T:
    return call()


def episode_run(
    *,
    trajectory_id: int,
    task: TaskSpec,
    env: EnvSource,
    policy: PolicyEndpoint,
    recorder: Recorder,
    config: EpisodeConfig,
    pacer: Pacer | None = None,
    db: Callable[[Callable[[], Any]], Any] = _here,
) -> EpisodeOutcome:
    """Run one episode of the started trajectory `trajectory_id` and end the trajectory
    (see the module docstring for how). `db` runs the trajectory's end (bench/scale_slots.py
    hands it to its pool of database threads). Raises only what ending the trajectory
    raises (the database away past the retry budget even then)."""
    fields: dict[str, Any] = {"reward": None}
    try:
        result = play_episode(
            env=env.open(), policy=policy, recorder=recorder, task=task, config=config, pacer=pacer
        )
    except Exception as exc:
        outcome = _failure(exc)
        fields["error"] = outcome.reason
        if outcome.end is EpisodeEnd.STORAGE:
            log.error("trajectory %s: %s", trajectory_id, outcome.reason)
            if is_disk_full(exc):
                run_id = (
                    Trajectory.objects.filter(pk=trajectory_id)
                    .values_list("run_id", flat=True)
                    .first()
                )
                if run_id is not None:
                    run_pause_for_disk(
                        run_id=run_id, what=f"a step of trajectory {trajectory_id}", exc=exc
                    )
        elif outcome.env_failed:
            log.warning(
                "trajectory %s: %s on %s", trajectory_id, outcome.reason.splitlines()[0], task.name
            )
    else:
        outcome = EpisodeOutcome(end=EpisodeEnd.RAN, status=TrajectoryStatus(result.status))
        fields = {
            "reward": result.reward,
            "details": result.details,
            "env_ms": result.env_ms,
            "model_ms": result.model_ms,
        }
    db(lambda: trajectory_end(trajectory_id, status=outcome.status, **fields))
    if outcome.env_failed:
        env.discard()
    return outcome


def _failure(exc: Exception) -> EpisodeOutcome:
    """How an exception out of an episode ends its trajectory."""
    error = TrajectoryStatus.ERROR
    if isinstance(exc, SlotTakenOver):
        return EpisodeOutcome(EpisodeEnd.TAKEN_OVER, TrajectoryStatus.ABORTED, str(exc), exc)
    if isinstance(exc, DatabaseUnavailable | StorageUnavailable):
        # The steps recorded so far stay; the episode ends with the reason once the database
        # answers again (or, if it never does here, the watchdog ends it). The env is fine.
        service = "database" if isinstance(exc, DatabaseUnavailable) else "storage"
        return EpisodeOutcome(EpisodeEnd.OUTAGE, error, f"{service}: {exc}", exc)
    if isinstance(exc, BotoCoreError | ClientError):
        # The object storage refused a screenshot for good (a missing bucket, a refused
        # credential): the operator's to fix, not the environment's fault.
        reason = f"storage: {type(exc).__name__}: {exc}"
        return EpisodeOutcome(EpisodeEnd.STORAGE, error, reason, exc)
    if isinstance(exc, InferenceError):
        return EpisodeOutcome(EpisodeEnd.INFERENCE, error, f"inference: {exc}", exc)
    if is_disk_full(exc):
        # A full disk is the host's, not the environment's: the run pauses (episode_run).
        return EpisodeOutcome(EpisodeEnd.STORAGE, error, f"disk full: {exc}", exc)
    reason = f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, EnvUnavailable):
        reason += "\n" + "".join(traceback.format_exception(exc, limit=5))
    return EpisodeOutcome(EpisodeEnd.ENV, error, reason, exc)
