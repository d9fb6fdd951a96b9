"""This process's environments: one per backend (one per VM for osworld), created on first
use and kept across episodes and tasks, because starting a browser, a desktop or a VM
connection costs seconds and an episode a few.

Env slots (workers.slot_worker), evaluation shards (workers.evaluation) and collect_demos
open envs here; an episode runner that saw an env fail discards it, so the next use
creates a fresh one. `env_cache_reset` closes them all (tests, between runs).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings

from core.protocol import Env
from datamanager.config import EnvConfig
from envmanager.busy import PROCESS_CLOCK, BusyEnv
from envmanager.desktop_env import DesktopEnv
from envmanager.latency import PROFILES, LatencyEnv, profile_from_settings
from envmanager.miniwob_env import MiniWoBEnv
from envmanager.oracle_policy import ObservedEnv, OracleEndpoint
from envmanager.sim_env import sim_env
from envmanager.threaded import ThreadedEnv
from rollout.auth import desktop_purpose, purpose_token

if TYPE_CHECKING:
    from envmanager.osworld_env import Provider

log = logging.getLogger("dartboard.slots")

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
        # Imported here, as in make_env: the OSWorld client is an osworld slot's alone.
        from envmanager.osworld_env import Provider

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
        # Imported here: the OSWorld client (requests, the evaluator's helpers) is an
        # osworld slot's alone, and every worker imports this module at its start.
        from envmanager.osworld_env import OSWorldEnv
        from envmanager.osworld_file_cache import FileCache

        # The desktop's own token: one read inside a desktop opens no other (rollout.auth).
        token = purpose_token(settings.DARTBOARD_SERVICE_TOKEN, desktop_purpose(vm.address))
        return ThreadedEnv(
            lambda: OSWorldEnv(
                address=vm.address,
                token=token,
                provider=vm.provider,
                file_cache=FileCache(settings.OSWORLD_FILE_CACHE),
            ),
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


def _close(key: str, env: Env) -> None:
    try:
        env.close()
    except Exception:
        log.exception("closing a %s env failed (it is replaced anyway)", key)


def discard_env(backend: str, *, vm: VMTarget | None = None) -> None:
    """Close (best effort) and forget the process's env; the next use creates a fresh one."""
    key = _env_key(backend, vm)
    env = _ENVS.pop(key, None)
    if env is not None:
        _close(key, env)


def discard_backend_envs(backend: str) -> None:
    """discard_env for every env of `backend` in this process (each VM's, for osworld)."""
    for key in [k for k in _ENVS if k == backend or k.startswith(f"{backend}@")]:
        _close(key, _ENVS.pop(key))


def env_cache_reset() -> None:
    """Close (best effort) and forget every env of this process: a test's clean start."""
    for key in list(_ENVS):
        _close(key, _ENVS.pop(key))


@dataclass(frozen=True)
class TaskEnv:
    """The cached env a task runs on: its backend's (an osworld task's on its VM: the task's
    own address, else the run's VM of slot `index`), watched by the scripted `oracle` when
    that is the policy. The episode runner opens it inside its error handling, so a task
    with no VM (NoVMForTask) ends its episode like any env failure."""

    backend: str
    env_config: dict[str, Any]
    env: EnvConfig
    index: int = 0
    timeout_s: float = 30.0
    oracle: OracleEndpoint | None = None

    def _vm(self) -> VMTarget | None:
        if self.backend != "osworld":
            return None
        return osworld_target(env_config=self.env_config, env=self.env, index=self.index)

    def open(self) -> Env:
        env = process_env(self.backend, timeout_s=self.timeout_s, vm=self._vm())
        return env if self.oracle is None else ObservedEnv(env, self.oracle)

    def discard(self) -> None:
        try:
            vm = self._vm()
        except NoVMForTask:
            return  # no VM, so no env of it was ever opened
        discard_env(self.backend, vm=vm)
