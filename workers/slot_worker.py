"""Env slots: a worker process owns one long-lived environment and runs episodes on it.

`serve_slot` is called by the Celery task in `workers.tasks` (queue `env`, one solo
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
import traceback
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from django.conf import settings
from django.db import connection

from core.protocol import Env, EnvUnavailable, TaskSpec
from datamanager.config import EnvConfig, RunConfig
from datamanager.models import Run, RunStatus, SlotStatus
from datamanager.policies import ORACLE_POLICY, policy_geometry
from datamanager.roles import run_env_check
from datamanager.services import env_slots as slot_services
from datamanager.services import episodes
from datamanager.services.runs import run_set_message
from envmanager.busy import PROCESS_CLOCK, BusyEnv
from envmanager.desktop_env import DesktopEnv
from envmanager.latency import PROFILES, LatencyEnv, profile_from_settings
from envmanager.miniwob_env import MiniWoBEnv
from envmanager.oracle_policy import ObservedEnv, OracleEndpoint
from envmanager.osworld_env import OSWorldEnv, Provider
from envmanager.sandbox import host_limits_problem
from envmanager.sim_env import sim_env
from envmanager.threaded import ThreadedEnv
from rollout.auth import desktop_purpose, purpose_token
from rollout.client import InferenceError, PolicyClient
from rollout.episode import Pacer, PolicyEndpoint, StepRecord, run_episode
from workers.config_mapping import episode_config
from workers.dbutil import DatabaseUnavailable, StorageUnavailable, db_retry, refresh_connection
from workers.leases import RedisLease, slot_work
from workers.lifecycle import shutdown_requested
from workers.lockstep import RedisLockstep

log = logging.getLogger("dartboard.slots")

# One environment per worker process and backend, reused across episodes and tasks.
_ENVS: dict[str, Env] = {}


@dataclass(frozen=True)
class VMTarget:
    """The OSWorld VM an osworld episode runs on, and how to revert it (if configured)."""

    address: str
    provider: Provider | None = None


class NoVMForTask(RuntimeError):
    """An osworld task with no VM: neither its env_config nor the run names one."""


def osworld_target(*, env_config: dict[str, Any], env: EnvConfig, index: int) -> VMTarget:
    """The task's own `address` (a VM it needs), else the run's VM of this slot index."""
    if isinstance(env_config.get("address"), str):
        return VMTarget(address=env_config["address"])
    pool = env.osworld_addresses
    if not pool:
        raise NoVMForTask(
            "an osworld task needs a VM: give the run env.osworld_addresses (host:port), or "
            "the task an env_config 'address'"
        )
    i = index % len(pool)
    provider = None
    if env.osworld_provider:
        provider = Provider(
            name=env.osworld_provider,
            vm_path=env.osworld_vm_paths[i],
            snapshot=env.osworld_snapshot,
            region=env.osworld_region,
        )
    return VMTarget(address=pool[i], provider=provider)


def make_env(backend: str, *, timeout_s: float = 30.0, vm: VMTarget | None = None) -> Env:
    """A backend on its own thread, every call limited to `timeout_s` (envmanager.threaded)."""
    if backend == "osworld":
        if vm is None:
            raise NoVMForTask("an osworld env needs a VM address")
        # The desktop's own token: one read inside a desktop opens no other (rollout.auth).
        token = purpose_token(settings.DARTBOARD_SERVICE_TOKEN, desktop_purpose(vm.address))
        return ThreadedEnv(
            lambda: OSWorldEnv(address=vm.address, token=token, provider=vm.provider),
            timeout_s=timeout_s,
        )
    if backend == "miniwob":
        return ThreadedEnv(MiniWoBEnv, timeout_s=timeout_s)
    if backend == "desktop":
        return ThreadedEnv(DesktopEnv, timeout_s=timeout_s)
    if backend == "sim":
        # Simulated slots always take an OSWorld VM's time (scaled by
        # DARTBOARD_ENV_LATENCY_SCALE): their point is the control plane's load.
        latency = PROFILES["osworld"].scaled(settings.DARTBOARD_ENV_LATENCY_SCALE)
        return sim_env(latency=latency, seed=os.getpid())
    raise ValueError(f"unknown env backend {backend!r}; use miniwob, desktop, sim or osworld")


def _env_key(backend: str, vm: VMTarget | None) -> str:
    return backend if vm is None else f"{backend}@{vm.address}"


def process_env(backend: str, *, timeout_s: float = 30.0, vm: VMTarget | None = None) -> Env:
    """This process's env of `backend` (one per VM for osworld), created on first use."""
    key = _env_key(backend, vm)
    env = _ENVS.get(key)
    if env is None:
        env = make_env(backend, timeout_s=timeout_s, vm=vm)
        profile = profile_from_settings(
            settings.DARTBOARD_ENV_LATENCY, settings.DARTBOARD_ENV_LATENCY_SCALE
        )
        if profile is not None and backend != "sim":  # sim has its latency built in
            env = LatencyEnv(env, profile, seed=os.getpid())
        env = BusyEnv(env, PROCESS_CLOCK)
        _ENVS[key] = env
    return env


def discard_env(backend: str, *, vm: VMTarget | None = None) -> None:
    """Close (best effort) and forget the process's env; the next use creates a fresh one."""
    env = _ENVS.pop(_env_key(backend, vm), None)
    if env is not None:
        try:
            env.close()
        except Exception:
            log.exception("closing a broken %s env failed (it is replaced anyway)", backend)


def discard_backend_envs(backend: str) -> None:
    """discard_env for every env of `backend` in this process (each VM's, for osworld)."""
    for key in [k for k in _ENVS if k == backend or k.startswith(f"{backend}@")]:
        env = _ENVS.pop(key)
        try:
            env.close()
        except Exception:
            log.exception("closing a %s env failed (it is replaced anyway)", key)


class SlotTakenOver(RuntimeError):
    """Another worker holds this slot's lease now (this one lost it during an outage)."""


class DbRecorder:
    """Records an episode's steps through the data manager's services, retrying while the
    database is away. With a `lost` event (the slot's lease went to another worker) it
    refuses to record more."""

    def __init__(self, trajectory_id: int, lost: threading.Event | None = None) -> None:
        self.trajectory_id = trajectory_id
        self.head: episodes.TrajectoryHead | None = None
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
            self.head = episodes.trajectory_head(trajectory_id=self.trajectory_id)

        db_retry(write, what=f"starting trajectory {self.trajectory_id}")

    def record_step(self, record: StepRecord) -> None:
        self._check_lease()
        db_retry(
            lambda attempt: self._write_step(record, resume=attempt > 0),
            what=f"recording step {record.index} of trajectory {self.trajectory_id}",
        )

    def _write_step(self, record: StepRecord, *, resume: bool) -> None:
        episodes.step_record(
            trajectory_id=self.trajectory_id,
            index=record.index,
            screenshot_png=record.screenshot_png,
            width=record.width,
            height=record.height,
            raw_output=record.raw_output,
            thought=record.thought,
            action=record.action,
            parse_error=record.parse_error,
            prompt_tokens=record.prompt_tokens,
            response_tokens=record.response_tokens,
            rollout_logprobs=record.rollout_logprobs,
            response_token_ids=record.response_token_ids,
            mean_entropy=record.mean_entropy,
            policy_version=record.policy_version,
            env_ms=record.env_ms,
            model_ms=record.model_ms,
            head=self.head,
            resume=resume,
        )


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
                    log.error("slot %s: its lease %s is held by another worker; leaving the "
                              "slot to it", self.slot_id, self.lease.key)  # fmt: skip
                    self.lost.set()
                    return
                self._beat(
                    "database",
                    lambda: slot_services.env_slot_heartbeat(
                        slot_id=self.slot_id, env_busy_s=self.busy.seconds()
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
                log.warning("slot %s heartbeat: %s unreachable (%s: %s); retrying",
                            self.slot_id, service, type(exc).__name__, exc)  # fmt: skip
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


def slot_name(backend: str, index: int) -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{backend}:{index}"


def inference_urls() -> list[str]:
    return list(settings.DARTBOARD_INFERENCE_URLS)


def serve_slot(
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
    Raises EnvNotGranted (datamanager.roles) for a desktop or VM slot its run was not given."""
    run = Run.objects.select_related("owner").get(pk=run_id)
    # A slot task can come from anything that reaches the broker (Flower's API, say), not
    # only from the launcher: a desktop or a VM only for a run an admin gave them to.
    run_env_check(run=run, backend=backend, index=index)
    cfg = RunConfig.from_dict(run.config)
    name = slot_name(backend, index)
    if backend == "osworld" and cfg.env.osworld_addresses:  # the env wall shows the VM
        name += f"@{cfg.env.osworld_addresses[index % len(cfg.env.osworld_addresses)]}"
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
        inference_urls(),
        timeout=cfg.rollout.request_timeout_s,
        token=settings.DARTBOARD_INFERENCE_TOKEN,
    )
    deadline = time.monotonic() + max_seconds
    episodes_run = 0
    try:
        slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.IDLE)
        while time.monotonic() < deadline:
            if shutdown_requested.is_set():
                slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.STOPPED)
                return SlotOutcome(True, "worker shutting down")
            if heartbeat.lost.is_set():
                return SlotOutcome(False, f"slot {backend}:{index} was taken over by another "
                                   "worker while Redis was away")  # fmt: skip
            refresh_connection()
            claim = db_retry(
                lambda _: episodes.task_claim(run_id=run_id, slot_id=slot.pk, env_kinds=(backend,)),
                what=f"claiming a task for slot {backend}:{index}",
            )
            if claim is None:
                if pacer is not None:
                    slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.IDLE)
                    return SlotOutcome(False, "nothing to claim this round")
                status = Run.objects.values_list("status", flat=True).get(pk=run_id)
                if status != RunStatus.RUNNING:
                    slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.STOPPED)
                    return SlotOutcome(False, f"run is {status}")
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
                slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.IDLE)
                return SlotOutcome(False, f"{episodes_run} episodes done")
        slot_services.env_slot_set(slot_id=slot.pk, status=SlotStatus.IDLE)
        return SlotOutcome(True, "time slice over")
    finally:
        heartbeat.stop_event.set()
        heartbeat.join(timeout=5)
        with contextlib.suppress(Exception):  # the figure only; the slot's outcome stands
            slot_services.env_slot_heartbeat(slot_id=slot.pk, env_busy_s=busy.seconds())
        lease.release()
        client.close()


def _finish(trajectory_id: int, **fields: Any) -> None:
    """End a trajectory, retrying while the database is away (finishing twice is a no-op)."""
    db_retry(
        lambda _: episodes.trajectory_finish(trajectory_id=trajectory_id, **fields),
        what=f"ending trajectory {trajectory_id}",
    )


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
    task = TaskSpec(
        name=claim.task_name,
        env_kind=claim.env_kind,
        env_config=claim.env_config,
        instruction=claim.instruction,
        seed=claim.seed,
    )
    vm: VMTarget | None = None
    try:
        if backend == "osworld":
            vm = osworld_target(env_config=claim.env_config, env=cfg.env, index=index)
        env = process_env(backend, timeout_s=cfg.env.step_timeout_s, vm=vm)
        policy: PolicyEndpoint = client
        if cfg.policy == ORACLE_POLICY:
            oracle = OracleEndpoint(geometry=policy_geometry(cfg.policy), coords=cfg.rollout.coords)
            env, policy = ObservedEnv(env, oracle), oracle
        result = run_episode(
            env=env,
            policy=policy,
            recorder=DbRecorder(claim.trajectory_id, lost),
            task=task,
            config=episode_config(cfg, step_cap=claim.step_cap, seed=claim.decode_seed),
            pacer=pacer,
        )
    except SlotTakenOver as exc:
        _finish(claim.trajectory_id, status="aborted", reward=None, error=str(exc))
        return True
    except (DatabaseUnavailable, StorageUnavailable) as exc:
        # The steps recorded so far stay; the episode ends with the reason once the database
        # answers again (or, if it never does here, the watchdog ends it). The environment
        # is fine: it is kept, and the slot is not counted as failing.
        service = "database" if isinstance(exc, DatabaseUnavailable) else "storage"
        _finish(claim.trajectory_id, status="error", reward=None, error=f"{service}: {exc}")
        slot_services.env_slot_set(slot_id=slot_id, status=SlotStatus.IDLE)
        return False
    except (BotoCoreError, ClientError) as exc:
        # The object storage refused a screenshot for good (a missing bucket, a refused
        # credential): the operator's to fix, not the environment's fault.
        reason = f"storage: {type(exc).__name__}: {exc}"
        log.error("slot %s: %s", slot_id, reason)
        _finish(claim.trajectory_id, status="error", reward=None, error=reason)
        slot_services.env_slot_set(slot_id=slot_id, status=SlotStatus.IDLE)
        time.sleep(2.0)
        return False
    except InferenceError as exc:
        # The policy did not answer: the episode is lost, but the env is fine.
        _finish(claim.trajectory_id, status="error", reward=None, error=f"inference: {exc}")
        slot_services.env_slot_set(slot_id=slot_id, status=SlotStatus.IDLE)
        time.sleep(2.0)
        return False
    except Exception as exc:
        # Anything else came from the environment (or its driver): record it, recreate.
        reason = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, EnvUnavailable):
            reason += "\n" + traceback.format_exc(limit=5)
        log.warning("slot %s: %s on %s", slot_id, reason.splitlines()[0], claim.task_name)
        _finish(claim.trajectory_id, status="error", reward=None, error=reason)
        discard_env(backend, vm=vm)
        return slot_services.env_slot_failure(
            slot_id=slot_id, error=reason, quarantine_after=cfg.env.quarantine_after
        )
    _finish(
        claim.trajectory_id,
        status=result.status,
        reward=result.reward,
        details=result.details,
        env_ms=result.env_ms,
        model_ms=result.model_ms,
    )
    slot_services.env_slot_success(slot_id=slot_id)
    slot_services.env_slot_set(slot_id=slot_id, status=SlotStatus.IDLE)
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
        reason = serve_slot(
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
