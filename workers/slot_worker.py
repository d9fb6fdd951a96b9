"""Env slots: a worker process owns one long-lived environment and runs episodes on it.

`serve_slice` is called by the Celery task in `workers.tasks` (queue `env`, one solo
worker process per slot). It claims tasks rollout-wise, runs episodes, records every step,
and keeps a heartbeat on its `EnvSlot` row. A reset/step that raises or times out marks the
trajectory `error` with the exception text, recreates the environment and goes on; after
`quarantine_after` failures in a row the slot is quarantined with its last error.

Outages: a step or an episode's end that cannot be written is retried while the database or
the object storage (screenshots) is away (workers/dbutil.py, DARTBOARD_DB_RETRY_S); past that
the episode ends `error` with the reason, its recorded steps intact. The heartbeat rides out
Redis and database outages; if another worker took the slot's lease meanwhile (an outage
longer than the lease), this worker ends its episode `aborted` and leaves the slot to it: a
slot has one worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import connection

from datamanager.config import RunConfig
from datamanager.live_work import slot_work
from datamanager.models import Run, RunStatus, SlotStatus
from datamanager.policies import ORACLE_POLICY, policy_geometry
from datamanager.roles import run_env_check
from datamanager.selectors.flow import Backlog, training_backlog
from datamanager.selectors.runs import run_own_router
from datamanager.services import env_slots as slot_services
from datamanager.services import episodes
from datamanager.services.evaluations import eval_lanes
from datamanager.services.runs import run_set_message
from envmanager.busy import PROCESS_CLOCK
from envmanager.oracle_policy import OracleEndpoint
from envmanager.sandbox_limits import host_limits_problem
from rollout.client import PolicyClient
from rollout.episode import Pacer, PolicyEndpoint
from workers.config_mapping import episode_config
from workers.dbutil import db_retry, refresh_connection
from workers.disk import home_disk
from workers.env_cache import TaskEnv
from workers.episode_runner import DbRecorder, EpisodeEnd, episode_run
from workers.evaluation import eval_shard_waiting
from workers.leases import RedisLease
from workers.lifecycle import shutdown_requested
from workers.lockstep import RedisLockstep

log = logging.getLogger("dartboard.slots")


class _SlotBusy:
    """The slot row's environment busy time: what the row held when this process started
    serving it, plus the process clock's time since. A process may serve several slot rows
    in turn (a synchronous round hands out any index), so each row counts only its own."""

    def __init__(self, stored_s: float) -> None:
        self.stored_s = stored_s
        self.clock_at_start = PROCESS_CLOCK.seconds()

    def seconds(self) -> float:
        return self.stored_s + PROCESS_CLOCK.seconds() - self.clock_at_start


class _Heartbeat(threading.Thread):
    """Renews the slot's lease and beats on its row. It rides out outages (Redis or the
    database away: it says so once and keeps trying); if another worker holds the lease
    when Redis answers again, it sets `lost` and stops."""

    def __init__(self, slot_id: int, period: float, lease: RedisLease, busy: _SlotBusy) -> None:
        super().__init__(daemon=True, name=f"heartbeat-{slot_id}")
        self.slot_id = slot_id
        self.period = min(period, lease.ttl_s / 3)
        self.lease = lease
        self.busy = busy
        self.stop_event = threading.Event()
        self.lost = threading.Event()
        self._failing: set[str] = set()

    def run(self) -> None:
        try:
            while not self.stop_event.wait(self.period):
                if self._beat("redis", self.lease.renew) is False:
                    log.error(
                        "slot %s: its lease %s is held by another worker; leaving the slot to it",
                        self.slot_id,
                        self.lease.key,
                    )
                    self.lost.set()
                    return
                self._beat(
                    "database",
                    lambda: slot_services.env_slot_heartbeat(
                        slot_id=self.slot_id, env_busy_s=self.busy.seconds(), disk=home_disk()
                    ),
                )
        finally:
            connection.close()

    def _beat(self, service: str, call: Any) -> Any:
        """One call; a failure is logged once per outage, and None returned."""
        try:
            result = call()
        except Exception as exc:
            if service not in self._failing:
                log.warning(
                    "slot %s heartbeat: %s unreachable (%s: %s); retrying",
                    self.slot_id,
                    service,
                    type(exc).__name__,
                    exc,
                )
                self._failing.add(service)
            if service == "database":
                connection.close()  # the next beat opens a fresh connection
            return None
        if service in self._failing:
            log.warning("slot %s heartbeat: %s is back", self.slot_id, service)
            self._failing.discard(service)
        return result


@dataclass(frozen=True)
class SlotOutcome:
    keep_going: bool  # re-enqueue the slot task
    reason: str


def slot_name(backend: str, index: int, cfg: RunConfig) -> str:
    """host:pid:backend:index, and an osworld slot's VM (the env wall shows it)."""
    name = f"{socket.gethostname()}:{os.getpid()}:{backend}:{index}"
    if backend == "osworld" and cfg.env.osworld_addresses:
        name += f"@{cfg.env.osworld_addresses[index % len(cfg.env.osworld_addresses)]}"
    return name


def inference_urls(*, run_id: int) -> list[str]:
    """The run's own router (a host agent's placement), else the shared rollout service."""
    own = run_own_router(run_id=run_id)
    return [own] if own else list(settings.DARTBOARD_INFERENCE_URLS)


def serve_slice(
    *,
    run_id: int,
    backend: str,
    index: int,
    max_seconds: float,
    max_episodes: int | None = None,
    pacer: Pacer | None = None,
) -> SlotOutcome:
    """Run episodes for `run_id` on this process's env until the run stops, time is up or
    `max_episodes` episodes ran (the synchronous baseline runs one per slot per round).
    With a `pacer` (a lockstep round), a slot with nothing to claim sits the round out
    instead of waiting for a task, so the rest of the batch does not wait for it.
    Raises EnvNotGranted (datamanager.roles) for a desktop or VM slot its run was not given.

    Long because it is one slot's life in order (the lease, registration, the heartbeat, then
    the loop: hand over to evaluation, claim, held, play, stop), and each way out sets the
    slot's status where it happens, so the statuses a slot can end in read in one place."""
    run = Run.objects.select_related("owner").get(pk=run_id)
    # A slot task can come from anything that reaches the broker (Flower's API, say), not
    # only from the launcher: a desktop or a VM only for a run an admin gave them to.
    run_env_check(run=run, backend=backend, index=index)
    cfg = run.cfg
    name = slot_name(backend, index, cfg)
    # At most one live worker serves a slot: a duplicate slot task (the watchdog's, or one
    # re-enqueued by a worker that shut down while the launcher started the run again) finds
    # the lease held and ends.
    work = slot_work(run_id=run_id, backend=backend, index=index)
    lease = RedisLease(key=work.lease_key, holder=name)
    holder = lease.acquire()
    if holder is not None:
        lease.release()  # not ours: closes the connection only
        return SlotOutcome(False, f"slot {backend}:{index} of run {run_id} is served by {holder}")
    slot = slot_services.env_slot_register(
        name=name,
        host=socket.gethostname(),
        backend=backend,
        run_id=run_id,
        sandbox_note=_sandbox_note(backend),
    )
    busy = _SlotBusy(slot.env_busy_s)
    heartbeat = _Heartbeat(slot.pk, cfg.env.heartbeat_s, lease, busy)
    heartbeat.start()
    client = PolicyClient(
        inference_urls(run_id=run_id),
        timeout=cfg.rollout.request_timeout_s,
        token=settings.DARTBOARD_INFERENCE_TOKEN,
    )
    deadline = time.monotonic() + max_seconds
    episodes_run = 0
    try:
        slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.IDLE)
        held = False  # the tile says "held" once per spell, not once a second
        while time.monotonic() < deadline:
            if index < eval_lanes(cfg) and (
                shard := eval_shard_waiting(run_id=run_id, index=index)
            ):
                slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.RELEASED)
                return SlotOutcome(True, f"handed over to {shard}")
            claim = _next_claim(
                run_id=run_id,
                slot_id=slot.pk,
                backend=backend,
                index=index,
                cfg=cfg,
                paced=pacer is not None,
                lost=heartbeat.lost,
            )
            if isinstance(claim, SlotOutcome):
                return claim
            if isinstance(claim, Backlog) and not held:
                slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.HELD)
            held = isinstance(claim, Backlog)
            if claim is None or isinstance(claim, Backlog):
                time.sleep(1.0)
                continue
            quarantined = _run_claim(
                claim, slot.pk, backend, cfg, client, pacer, heartbeat.lost, index=index
            )
            if quarantined:
                taken = heartbeat.lost.is_set()
                return SlotOutcome(False, "slot taken over" if taken else "slot quarantined")
            episodes_run += 1
            if max_episodes is not None and episodes_run >= max_episodes:
                slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.RELEASED)
                return SlotOutcome(False, f"{episodes_run} episodes done")
        # The slot's task is queued again: the wall shows the slot waiting, not this row lost.
        slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.RELEASED)
        return SlotOutcome(True, "time slice over")
    finally:
        heartbeat.stop_event.set()
        heartbeat.join(timeout=5)
        with contextlib.suppress(Exception):  # the figure only; the slot's outcome stands
            slot_services.env_slot_heartbeat(slot_id=slot.pk, env_busy_s=busy.seconds())
        lease.release()
        client.close()


def _next_claim(
    *,
    run_id: int,
    slot_id: int,
    backend: str,
    index: int,
    cfg: RunConfig,
    paced: bool,
    lost: threading.Event,
) -> episodes.Claim | SlotOutcome | Backlog | None:
    """The slot's next claim; else its outcome when it stops (the worker shuts down, the slot
    was taken over, the run stopped; a `paced` slot sits a round with nothing to claim out),
    the trainer's backlog while it holds (backpressure: no new group is opened; a begun
    group's rollouts are still claimed), or None: wait, then try
    again. A paced slot (the synchronous loop) is never held: its trainer waits for it."""
    if shutdown_requested.is_set():  # its task goes back to the queue
        slot_services.env_slot_set(slot_id=slot_id, status=SlotStatus.RELEASED)
        return SlotOutcome(True, "worker shutting down")
    if lost.is_set():
        return SlotOutcome(
            False, f"slot {backend}:{index} was taken over by another worker while Redis was away"
        )
    refresh_connection()
    if not paced:
        backlog = db_retry(
            lambda _: training_backlog(run_id=run_id, cfg=cfg),
            what=f"reading the training backlog for slot {backend}:{index}",
        )
        if backlog.held:
            # Held: no new group is opened, but the groups under way are completed.
            begun = db_retry(
                lambda _: episodes.task_claim(
                    run_id=run_id, slot_id=slot_id, env_kinds=(backend,), begun_only=True
                ),
                what=f"claiming a begun group's rollout for slot {backend}:{index}",
            )
            return begun if begun is not None else backlog
    claim = db_retry(
        lambda _: episodes.task_claim(run_id=run_id, slot_id=slot_id, env_kinds=(backend,)),
        what=f"claiming a task for slot {backend}:{index}",
    )
    if claim is not None:
        return claim
    if paced:
        slot_services.env_slot_set(slot_id=slot_id, status=SlotStatus.RELEASED)
        return SlotOutcome(False, "nothing to claim this round")
    status = Run.objects.values_list("status", flat=True).get(pk=run_id)
    if status != RunStatus.RUNNING:
        slot_services.env_slot_set(slot_id=slot_id, status=SlotStatus.STOPPED)
        return SlotOutcome(False, f"run is {status}")
    return None


def _run_claim(
    claim: episodes.Claim,
    slot_id: int,
    backend: str,
    cfg: RunConfig,
    client: PolicyClient,
    pacer: Pacer | None = None,
    lost: threading.Event | None = None,
    *,
    index: int = 0,
) -> bool:
    """One episode of a claim; returns True when the slot got quarantined or taken over.
    `index`: the slot's number among its backend's (an osworld slot's VM in the pool)."""
    slot_services.env_slot_set(
        slot_id=slot_id, status=SlotStatus.BUSY, trajectory_id=claim.trajectory_id
    )
    policy: PolicyEndpoint = client
    oracle = None
    if cfg.policy == ORACLE_POLICY:
        oracle = OracleEndpoint(geometry=policy_geometry(cfg.policy), coords=cfg.rollout.coords)
        policy = oracle
    outcome = episode_run(
        trajectory_id=claim.trajectory_id,
        task=claim.task,
        env=TaskEnv(
            backend=backend,
            env_config=claim.task.env_config,
            env=cfg.env,
            index=index,
            timeout_s=cfg.env.step_timeout_s,
            oracle=oracle,
        ),
        policy=policy,
        recorder=DbRecorder(claim.trajectory_id, lost),
        config=episode_config(cfg, step_cap=claim.step_cap, seed=claim.decode_seed),
        pacer=pacer,
    )
    if outcome.end is EpisodeEnd.TAKEN_OVER:
        return True
    if outcome.env_failed:  # the env was recreated; enough failures in a row quarantine
        return slot_services.env_slot_failure(
            slot_id=slot_id, error=outcome.reason, quarantine_after=cfg.env.quarantine_after
        )
    if outcome.end is EpisodeEnd.RAN:
        slot_services.env_slot_success(slot_id=slot_id)
    # An outage is not the slot's failure either; its env is kept.
    slot_services.env_slot_set(slot_id=slot_id, status=SlotStatus.IDLE)
    if outcome.end in (EpisodeEnd.STORAGE, EpisodeEnd.INFERENCE):
        time.sleep(2.0)  # the operator's or the policy server's to fix: do not spin on it
    return False


def serve_lockstep_episode(
    *, run_id: int, backend: str, index: int, lockstep: dict[str, Any] | None
) -> str:
    """One episode on this slot (the synchronous baseline's rollout phase). `lockstep`
    ({"key", "members", "timeout_s"}) paces it turn by turn with the round's other slots
    (workers.lockstep); this slot leaves the round however its episode ends."""
    pacer = None
    if lockstep is not None:
        pacer = RedisLockstep(
            redis_url=settings.REDIS_URL,
            key=lockstep["key"],
            members=int(lockstep["members"]),
            timeout_s=float(lockstep["timeout_s"]),
        )
    try:
        reason = serve_slice(
            run_id=run_id,
            backend=backend,
            index=index,
            max_seconds=3600,
            max_episodes=1,
            pacer=pacer,
        ).reason
    finally:
        if pacer is not None:
            pacer.leave()
    if pacer is not None and pacer.broken:
        # Not only in this worker's log: the run says its batch loop lost a member.
        run_set_message(
            run_id=run_id,
            message=f"synchronous round: slot {backend}:{index} waited "
            f"{pacer.timeout_s:.0f} s for a member of its round that never arrived (a dead "
            "env worker?); the round went on without it",
        )
    return reason


def _sandbox_note(backend: str) -> str:
    """Why this host's sandboxes run unlimited, for the host map (local sandboxes only: an
    OSWorld desktop's sandbox lives on its VM host)."""
    if backend not in ("desktop", "miniwob"):
        return ""
    return host_limits_problem() or ""
