"""The host agent: each run's own processes, started when the run starts and stopped when
it stops, on the host with room for them.

With DARTBOARD_PROCESSES=per-run a started run waits as QUEUED with a queued placement
(`datamanager.services.run_workers.run_apply`). Every agent (one per host; `make run`'s
launcher runs one) reports its host (GPUs, CPU inference slots, env kinds) and, once a
second (`HostAgent.tick`):

- places queued runs that fit beside those already on its host (`hostagent.placement`),
  claims them in the database (one agent wins a run) and starts their processes: inference
  workers behind the run's own router on the run's ports and devices, a Celery train worker
  on the run's own queue (`train.run<id>`, its GPUs in CUDA_VISIBLE_DEVICES), one Celery env
  worker per env slot (`env.run<id>`);
- once the run's router answers, makes the run RUNNING and starts its work
  (`datamanager.services.run_workers.run_start_workers`: the router synced to its current version, its slot and
  trainer tasks on its queues);
- a run that does not fit keeps waiting, with the reason on its page; it starts when a run
  before it stops;
- stops the processes of runs that stopped, finished or failed (a paused run keeps them);
- restarts a run's crashed process (the launcher's supervisor), and brings back the
  processes of its runs after the agent itself restarts.

Everything it decides is in the database (`Host`, `RunPlacement`), so the web, the command
line and every other host see the same state. No scheduler service: Celery, the database
and Redis remain the engine.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import shutil
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from core.artifacts import is_ref
from datamanager.config import RunConfig
from datamanager.models import Host, PlacementState, Run, RunPlacement, RunStatus
from datamanager.policies import ORACLE_POLICY, policy_path
from datamanager.selectors.runs import HOST_ALIVE_S, run_current_policy
from datamanager.services.placement import (
    host_report,
    placement_claim,
    placement_move,
    placement_requeue_lost,
    placement_set,
    placement_wait,
)
from datamanager.services.run_workers import run_start_workers
from datamanager.services.runs import run_begin, run_fail, run_fail_queued, run_set_message
from envmanager.sandbox_limits import ALLOW_UNLIMITED_ENV, host_limits_problem, unlimited_allowed
from hostagent.cluster import ClusterPlacement, place_cluster
from hostagent.launcher import (
    CELERY,
    ProcSpec,
    Supervisor,
    env_worker_specs,
    python_argv,
    serving_specs,
)
from hostagent.log_ship import LogShipper
from hostagent.placement import (
    PORTS_PER_RUN,
    Gpu,
    HostInventory,
    Placement,
    RunNeeds,
    checkpoint_gib,
    port_block,
)
from hostagent.preflight import port_free
from rollout.client import RouterAdmin, WorkerStatus
from rollout.limits import ServingLimits
from training.config import RENDEZVOUS_ENV, REPLICAS_ENV, SHARD_ENV
from training.memory_plan import TrainerRequest, run_trainer_request, trainer_layout

log = logging.getLogger("hostagent.agent")

REPORT_EVERY_S = 10.0
HOST_LOST_S = 90.0  # a host silent this long is gone: its runs are placed again
SLOW_START_S = 300.0  # a run starting this long says what to read
ACTIVE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSED)


def host_inventory(name: str) -> HostInventory:
    """This host's GPUs (with their memory) and whether this torch can use them. A GPU
    host whose .venv holds the CPU torch build lists its GPUs from nvidia-smi, with
    cuda_torch False, so a GPU run placed here is refused with the fix."""
    import torch

    gpus: list[Gpu] = []
    cuda = torch.cuda.is_available()
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(Gpu(i, props.name, round(props.total_memory / 1024**3, 1)))
    elif shutil.which("nvidia-smi"):
        gpus = _nvidia_smi_gpus()
    return HostInventory(
        name=name,
        gpus=tuple(gpus),
        cuda_torch=cuda,
        cpu_inference_slots=settings.DARTBOARD_CPU_INFERENCE_SLOTS,
        address=settings.DARTBOARD_HOST_ADDRESS,
        env_kinds=tuple(env_kinds_here()),
        cpu_trainer_slots=settings.DARTBOARD_CPU_TRAINER_SLOTS,
        env_slots=settings.DARTBOARD_ENV_SLOTS,
    )


def reported_inventory(host: Host) -> HostInventory:
    """What another host's agent reported, as placement reads it."""
    return HostInventory(
        name=host.name,
        gpus=tuple(Gpu(int(g["index"]), str(g["name"]), float(g["memory_gib"])) for g in host.gpus),
        cuda_torch=host.cuda_torch,
        cpu_inference_slots=host.cpu_inference_slots,
        address=host.address,
        env_kinds=tuple(host.env_kinds),
        cpu_trainer_slots=host.cpu_trainer_slots,
        env_slots=host.env_slots,
    )


def _nvidia_smi_gpus() -> list[Gpu]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        index, name, mib = (part.strip() for part in line.split(","))
        gpus.append(Gpu(int(index), name, round(float(mib) / 1024, 1)))
    return gpus


def env_kinds_here() -> list[str]:
    """The env kinds this host offers: of those it can run (MiniWoB++ needs chromium,
    desktops Xvfb; the simulated env always runs; OSWorld VMs are reached over the network),
    the ones DARTBOARD_ENV_KINDS names, where it is set."""
    chromium = os.environ.get("MINIWOB_CHROME_BINARY", "/usr/bin/chromium")
    kinds = ["sim", "osworld"]
    sandboxed = []
    if Path(chromium).exists():
        sandboxed.append("miniwob")
    if shutil.which("Xvfb"):
        sandboxed.append("desktop")
    chosen = settings.DARTBOARD_ENV_KINDS
    if sandboxed and (chosen is None or set(sandboxed) & set(chosen)):
        # Browsers and desktops run in sandboxes with memory/pids cgroups and a task-dir
        # quota: a host that cannot make them (an agent not run as root) would fail every
        # episode, so it does not offer them unless the admin allowed unlimited sandboxes.
        problem = host_limits_problem()
        if problem and not unlimited_allowed():
            log.warning(
                "this host does not offer %s: %s (run the agent as root, or set %s=1)",
                " or ".join(sandboxed),
                problem,
                ALLOW_UNLIMITED_ENV,
            )
            sandboxed = []
    return sorted(k for k in [*kinds, *sandboxed] if chosen is None or k in chosen)


def run_needs(cfg: RunConfig, checkpoint: str, *, hosts: list[HostInventory]) -> RunNeeds:
    """What the run asks of the cluster `hosts`: its trainer's `auto` replicas and sharding
    decided for their GPUs (`training.memory_plan.trainer_layout`)."""
    scripted = cfg.policy == ORACLE_POLICY
    request = None if scripted else trainer_request(cfg)
    gpus = [g for h in hosts if h.cuda_torch for g in h.gpus]
    replicas, sharded = trainer_layout(
        cfg.trainer,
        request,
        gpu_gib=max(g.memory_gib for g in gpus) if gpus and cfg.device != "cpu" else None,
        gpus=len(gpus),
    )
    if request is not None:
        request = dataclasses.replace(request, shards=replicas if sharded else 1)
    return RunNeeds(
        inference_workers=0 if scripted else cfg.rollout.inference_workers,
        backend=cfg.rollout.backend,
        trainer_replicas=0 if scripted else replicas,
        device=cfg.device,
        vllm_gpus=cfg.rollout.vllm_gpus,
        vllm_gpu_memory=cfg.rollout.vllm_gpu_memory,
        weights_gib=0.0 if scripted else checkpoint_gib(checkpoint),
        lora=cfg.trainer.lora_rank > 0,
        shard=sharded,
        trainer=request,
    )


def trainer_request(cfg: RunConfig) -> TrainerRequest | None:
    """What the run's trainer asks of a GPU (`training.memory_plan`); None where its policy
    is in the store (not fetched to place the run) or not readable here."""
    if is_ref(cfg.policy):
        return None
    r = cfg.rollout
    return run_trainer_request(
        policy_path(cfg.policy),
        cfg.trainer,
        max_prompt_tokens=r.max_prompt_tokens,
        max_new_tokens=r.max_new_tokens,
        max_images=r.max_images,
    )


def cluster_address_problem(address: str, others: list[str]) -> str | None:
    """The one line to say when this host's address (DARTBOARD_HOST_ADDRESS, where its runs'
    routers and workers listen) is a loopback address while other hosts report: they cannot
    reach what runs here. None when it is fine."""
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:  # a name
        loopback = address == "localhost"
    if not loopback or not others:
        return None
    return (
        f"DARTBOARD_HOST_ADDRESS is {address}, a loopback address, but {len(others)} other "
        f"host{'s' if len(others) != 1 else ''} report ({', '.join(sorted(others)[:5])}): they "
        "cannot reach this host's routers and workers; set it to this host's cluster address"
    )


def run_prefix(run_id: int) -> str:
    return f"run-{run_id}-"


def run_specs(
    *, run_id: int, cfg: RunConfig, placement: Placement, checkpoint: str, version: int
) -> list[ProcSpec]:
    """A run's processes on this host, as its part of the placement says: its env workers,
    its train worker (the trainer's rank 0) and the trainer ranks that join it from here,
    and (with a model) its inference workers and its router, on the part's devices and
    ports. A whole part runs all of them (`Placement.whole`)."""
    prefix = run_prefix(run_id)
    env_workers = len(cfg.env.slots()) if placement.whole else placement.env_workers
    specs = env_worker_specs(
        env_workers, queue=f"env.run{run_id}", prefix=prefix, first=placement.env_first
    )
    trains = cfg.policy != ORACLE_POLICY or cfg.mode == "synchronous"
    if trains and (placement.whole or 0 in placement.trainer_ranks):
        devices = ",".join(map(str, placement.trainer_gpus))  # "": a CPU trainer sees no GPU
        env = {"CUDA_VISIBLE_DEVICES": devices}
        if placement.trainer_world:  # its auto replicas and sharding, as placed
            env[REPLICAS_ENV] = str(placement.trainer_world)
            env[SHARD_ENV] = "1" if placement.trainer_shard else "0"
        if placement.rendezvous:  # replicas on other hosts join it there
            env[RENDEZVOUS_ENV] = placement.rendezvous
        specs.append(
            ProcSpec(
                f"{prefix}worker-train",
                [*CELERY, "-Q", f"train.run{run_id}", "--pool=solo", "-n", f"train{run_id}@%h"],
                env=env,
            )
        )
    if trains and placement.rendezvous:
        specs += trainer_rank_specs(run_id=run_id, placement=placement, prefix=prefix)
    if cfg.policy == ORACLE_POLICY or not placement.inference_gpus:
        return specs
    if cfg.rollout.backend == "vllm":  # the router's first sync loads the run's version
        version, checkpoint = 0, str(policy_path(cfg.policy))
    specs += serving_specs(
        policy=checkpoint,
        version=version,
        backend=cfg.rollout.backend,
        router_port=placement.router_port,
        worker_ports=placement.worker_ports,
        gpus=placement.inference_gpus,
        vllm_gpu_memory=cfg.rollout.vllm_gpu_memory,
        device=placement.device,
        prefix=prefix,
        address=placement.address if not placement.whole else settings.DARTBOARD_HOST_ADDRESS,
        limits=ServingLimits.for_run(
            max_new_tokens=cfg.rollout.max_new_tokens,
            max_prompt_tokens=cfg.rollout.max_prompt_tokens,
            max_images=cfg.rollout.max_images,
            lora_rank=cfg.trainer.lora_rank,
        ),
        first=placement.inference_first,
        router=placement.router,
        router_workers=placement.router_workers or None,
    )
    return specs


def trainer_rank_specs(*, run_id: int, placement: Placement, prefix: str) -> list[ProcSpec]:
    """The trainer ranks but 0 of this host's part: each a process that joins the leader's
    group at the placement's rendezvous (`workers.trainer_rank`), started again by the
    supervisor when the group ends (a failed update, a lost host) to join the next one."""
    host, port = placement.rendezvous.rsplit(":", 1)
    devices = ",".join(map(str, placement.trainer_gpus))
    specs = []
    for local_rank, rank in enumerate(placement.trainer_ranks):
        if rank == 0:
            continue
        env = {
            "CUDA_VISIBLE_DEVICES": devices,
            "MASTER_ADDR": host,
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(placement.trainer_world),
            "DARTBOARD_RUN_ID": str(run_id),
        }
        argv = python_argv("-m", "workers.trainer_rank")
        specs.append(ProcSpec(f"{prefix}trainer-rank-{rank}", argv, env=env))
    return specs


def _current_policy(run: Run, cfg: RunConfig) -> tuple[int, str]:
    """The run's current (version, checkpoint); nothing for the scripted oracle."""
    if cfg.policy == ORACLE_POLICY:
        return 0, ""
    version, checkpoint = run_current_policy(run=run)
    return version, str(checkpoint)


class HostAgent:
    """Brings each run placed on this host to the processes it asks for (module doc)."""

    def __init__(self, *, home: Path, name: str | None = None, port_base: int = 8200) -> None:
        self.home = home
        self.name = name or socket.gethostname()
        self.port_base = port_base
        self.groups: dict[int, Supervisor] = {}
        self.inventory: HostInventory | None = None
        self.host: Host | None = None
        self._reported = 0.0
        self.log_shipper = LogShipper(host=self.name, prefix=run_prefix)

    # ------------------------------------------------------------------ the loop

    def tick(self) -> None:
        """One pass: report the host, stop what ended, place what waits, start the work of
        runs whose router came up, restart crashed processes, copy the logs that changed."""
        close_old_connections()
        if self.host is None or time.monotonic() - self._reported > REPORT_EVERY_S:
            self._report()
        self._stop_ended()
        self._restore()
        self._replace_lost_hosts()
        self._place_queued()
        self._promote_starting()
        self._move_off_taken_ports()
        for group in self.groups.values():
            group.watch_once()
        self._fail_what_cannot_start()
        self.log_shipper.ship(self.groups)  # after the stops: a stopped run's last words go too

    def stop_all(self) -> None:
        """The agent stops (the launcher's Ctrl-C): every run's processes stop, the runs keep
        their status and placement; the next agent brings them back."""
        for run_id in list(self.groups):
            self._stop_group(run_id)

    # ------------------------------------------------------------------ steps

    def _report(self) -> None:
        if self.inventory is None:
            self.inventory = host_inventory(self.name)
        inv = self.inventory
        self.host = host_report(
            name=self.name,
            gpus=[{"index": g.index, "name": g.name, "memory_gib": g.memory_gib} for g in inv.gpus],
            cuda_torch=inv.cuda_torch,
            cpu_cores=os.cpu_count() or 1,
            memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 1),
            cpu_inference_slots=inv.cpu_inference_slots,
            env_kinds=list(inv.env_kinds),
            address=inv.address,
            cpu_trainer_slots=inv.cpu_trainer_slots,
            env_slots=inv.env_slots,
        )
        if not self._reported:  # at start: an address the cluster's other hosts cannot reach
            others = list(
                Host.objects.exclude(name=self.name)
                .filter(last_seen__gte=timezone.now() - timedelta(seconds=HOST_ALIVE_S))
                .values_list("name", flat=True)
            )
            warning = cluster_address_problem(settings.DARTBOARD_HOST_ADDRESS, others)
            if warning:
                log.warning("%s", warning)
        self._reported = time.monotonic()

    def _mine(self):
        """The placed runs with a part on this host."""
        return RunPlacement.objects.filter(
            hosts=self.host, state__in=(PlacementState.STARTING, PlacementState.UP)
        ).select_related("run")

    def _my_part(self, placement: RunPlacement) -> Placement | None:
        return ClusterPlacement.from_dict(placement.plan).part(self.name)

    def _taken(self) -> dict[str, list[Placement]]:
        """Every host's parts of the runs placed on it."""
        taken: dict[str, list[Placement]] = {}
        placed = RunPlacement.objects.filter(
            state__in=(PlacementState.STARTING, PlacementState.UP)
        ).values_list("plan", flat=True)
        for plan in placed:
            for part in ClusterPlacement.from_dict(plan).parts:
                taken.setdefault(part.host, []).append(part)
        return taken

    def _cluster(self) -> list[HostInventory]:
        """This host and every host whose agent reported lately: this one first, the
        others by name."""
        assert self.inventory is not None
        recent = timezone.now() - timedelta(seconds=HOST_ALIVE_S)
        others = Host.objects.exclude(name=self.name).filter(last_seen__gte=recent)
        return [self.inventory, *(reported_inventory(h) for h in others.order_by("name"))]

    def _stop_ended(self) -> None:
        for placement in self._mine().exclude(run__status__in=ACTIVE):
            self._stop_group(placement.run_id)
            placement_set(placement_id=placement.pk, state=PlacementState.ENDED)
            log.info("run %s is %s: its processes stopped", placement.run_id, placement.run.status)
        for run_id in [r for r in self.groups if not self._mine().filter(run_id=r).exists()]:
            self._stop_group(run_id)  # its placement went (the run was deleted)

    def _restore(self) -> None:
        """Runs with a part here whose processes this agent does not hold (it restarted, or
        another host's agent placed the run)."""
        assert self.host is not None
        for placement in self._mine().filter(run__status__in=ACTIVE):
            part = self._my_part(placement)
            if placement.run_id not in self.groups and part is not None:
                log.info("run %s: bringing back its processes", placement.run_id)
                self._start_group(placement.run, part)
                if placement.host_id == self.host.pk:  # the router's host says when it is up
                    placement_set(placement_id=placement.pk, state=PlacementState.STARTING)

    def _replace_lost_hosts(self) -> None:
        """Runs placed on a host whose agent stopped reporting HOST_LOST_S ago go back to the
        queue, for this host or another (any live agent does it, once)."""
        seen_before = timezone.now() - timedelta(seconds=HOST_LOST_S)
        for run_id, host in placement_requeue_lost(seen_before=seen_before):
            log.warning("run %s: its host %s stopped reporting; placed again", run_id, host)

    def _place_queued(self) -> None:
        """Place each queued run over the hosts that report (`hostagent.cluster`), claim it
        and start this host's part; the other hosts' agents start theirs (`_restore`)."""
        assert self.host is not None and self.inventory is not None
        queued = RunPlacement.objects.filter(
            state=PlacementState.QUEUED, run__status__in=ACTIVE
        ).select_related("run")
        for placement in queued:
            run = placement.run
            try:
                cfg = run.cfg
                version, checkpoint = _current_policy(run, cfg)
            except Exception as exc:  # a policy gone from disk, a config no longer valid
                self._fail(placement, f"cannot start: {type(exc).__name__}: {exc}")
                continue
            plan = self._claim(placement, cfg, str(checkpoint))
            if plan is None:
                continue
            where = ", ".join(plan.hosts)
            run_set_message(run_id=run.pk, message=f"starting its processes on {where}")
            part = plan.part(self.name)
            if part is not None:
                self._start_group(run, part, cfg=cfg, checkpoint=str(checkpoint), version=version)

    def _claim(
        self, placement: RunPlacement, cfg: RunConfig, checkpoint: str
    ) -> ClusterPlacement | None:
        """Place a queued run over the cluster and claim it, or say why it waits (None).
        A run that does not fit locks nothing (it is asked again every tick); one that fits
        is placed again with the hosts' rows locked from reading what is taken to the claim,
        so two agents never give the same GPU twice (PostgreSQL; SQLite writes one
        transaction at a time)."""
        plan = self._plan(cfg, checkpoint)
        if isinstance(plan, str):
            reason = f"queued: {plan}"
            if reason != placement.reason:
                placement_wait(placement_id=placement.pk, reason=reason)
                run_set_message(run_id=placement.run_id, message=reason)
            return None
        with transaction.atomic():
            list(Host.objects.select_for_update().order_by("name").values_list("pk", flat=True))
            plan = self._plan(cfg, checkpoint)  # what another agent claimed meanwhile counts
            if isinstance(plan, str):
                return None  # said on the next tick
            rows = {h.name: h for h in Host.objects.filter(name__in=plan.hosts)}
            claimed = placement_claim(
                placement_id=placement.pk,
                host=rows[plan.lead.host],
                hosts=list(rows.values()),
                plan=plan.to_dict(),
                router_url=plan.router_url,
            )
        return plan if claimed else None  # else another agent took it, or the run stopped

    def _plan(self, cfg: RunConfig, checkpoint: str) -> ClusterPlacement | str:
        """The run's placement over the hosts that report, beside what is placed now."""
        hosts = self._cluster()
        taken = self._taken()
        bases = {h.name: self.port_base for h in hosts}
        bases[self.name] = self._free_base(taken.get(self.name, []))
        return place_cluster(
            run_needs(cfg, checkpoint, hosts=hosts),
            hosts,
            taken=taken,
            port_bases=bases,
            env_kinds={b for b, _ in cfg.env.slots()},
            env_workers=len(cfg.env.slots()),
        )

    def _free_base(self, taken: list[Placement]) -> int:
        """The first block of run ports whose ports no process holds (placed runs' blocks
        are skipped by `place` itself)."""
        base = self.port_base
        used = {p.router_port for p in taken}
        while base in used or not all(port_free(base + i) for i in range(PORTS_PER_RUN)):
            base += PORTS_PER_RUN
        return base

    def _move_off_taken_ports(self) -> None:
        """A run whose router or inference worker exited while another process holds its
        port (taken after the agent checked it, or while the agent was down) moves to a free
        block of ports: its serving processes start again there, its env workers and trainer
        keep running (they read the router's address from the placement), and the run says
        so. Restarted on the held port, the process would exit again and again. (A run
        spread over hosts does not move: its other hosts know its ports; a process that
        cannot start fails the run with its log's last line, `_fail_what_cannot_start`.)"""
        for run_id, group in list(self.groups.items()):
            taken = group.ports_taken()
            placement = self._mine().filter(run_id=run_id).first() if taken else None
            if placement is None or (
                "parts" in placement.plan and len(placement.plan["parts"]) > 1
            ):
                continue
            name, port = taken[0]
            run = placement.run
            try:
                cfg = run.cfg
                version, checkpoint = _current_policy(run, cfg)
            except Exception as exc:  # a policy gone from disk, a config no longer valid
                message = (
                    f"port {port} ({name}) is held by another process on {self.name}, and the "
                    f"run's processes cannot be started elsewhere: {type(exc).__name__}: {exc}"
                )
                if run.status_message != message:
                    run_set_message(run_id=run_id, message=message)
                    log.error("run %s: %s", run_id, message)
                continue
            old = ClusterPlacement.from_dict(placement.plan).parts[0]
            others = [
                part
                for p in self._mine().exclude(run_id=run_id)
                for part in ClusterPlacement.from_dict(p.plan).parts
                if part.host == self.name
            ]
            blocks = [*others, old]
            router, workers = port_block(
                len(old.worker_ports), base=self._free_base(blocks), taken=blocks
            )
            plan = dataclasses.replace(old, router_port=router, worker_ports=workers)
            specs = run_specs(
                run_id=run_id, cfg=cfg, placement=plan, checkpoint=checkpoint, version=version
            )
            group.respec(specs)
            reason = (
                f"port {port} ({name}) was held by another process on {self.name}: "
                f"the run's router and inference workers moved to ports {router}-"
                f"{router + PORTS_PER_RUN - 1}"
            )
            placement_move(
                placement_id=placement.pk,
                plan=plan.to_dict(),
                router_url=f"http://{settings.DARTBOARD_HOST_ADDRESS}:{router}",
                reason=reason,
            )
            run_set_message(run_id=run_id, message=reason)
            log.warning("run %s: %s", run_id, reason)

    def _promote_starting(self) -> None:
        """The runs this host answers for whose router answers: RUNNING, their work
        enqueued."""
        for placement in self._mine().filter(state=PlacementState.STARTING, host=self.host):
            if placement.router_url and not _router_up(placement.router_url):
                self._say_if_slow(placement)
                continue
            run = placement.run
            begun = run_begin(run_id=run.pk)
            placement_set(placement_id=placement.pk, state=PlacementState.UP)
            run.refresh_from_db()
            if begun or run.status == RunStatus.RUNNING:
                run_start_workers(run_id=run.pk)
                log.info("run %s is running on %s", run.pk, self.name)

    def _say_if_slow(self, placement: RunPlacement) -> None:
        """A run whose router has no live worker long after its processes started says so,
        with the logs to read (a worker that cannot load its checkpoint restarts in a loop)."""
        waited = (timezone.now() - placement.updated_at).total_seconds()
        if waited < SLOW_START_S:
            return
        logs = self.home / "logs" / f"{run_prefix(placement.run_id)}inference-0.log"
        message = (
            f"starting: the run's router at {placement.router_url} has no live inference "
            f"worker after {SLOW_START_S:.0f} s; read {logs} and the run's other logs there"
        )
        if placement.run.status_message != message:
            run_set_message(run_id=placement.run_id, message=message)

    # ------------------------------------------------------------------ processes

    def _start_group(
        self,
        run: Run,
        plan: Placement,
        *,
        cfg: RunConfig | None = None,
        checkpoint: str | None = None,
        version: int | None = None,
    ) -> None:
        cfg = cfg or run.cfg
        if checkpoint is None or version is None:
            version, checkpoint = _current_policy(run, cfg)
        specs = run_specs(
            run_id=run.pk, cfg=cfg, placement=plan, checkpoint=str(checkpoint), version=version
        )
        group = Supervisor(
            home=self.home,
            specs=specs,
            group=f"run-{run.pk}",
            give_up_after=settings.DARTBOARD_START_FAILURES,
        )
        group.start()
        self.groups[run.pk] = group
        log.info(
            "run %s: started %d processes on %s (%s, router port %s, checkpoint %s)",
            run.pk,
            len(specs),
            self.name,
            plan.device,
            plan.router_port or "-",
            checkpoint,
        )

    def _stop_group(self, run_id: int) -> None:
        group = self.groups.pop(run_id, None)
        if group is not None:
            group.stop()

    def _fail_what_cannot_start(self) -> None:
        """A run one of whose processes failed at start DARTBOARD_START_FAILURES times in a
        row fails, its processes stopped, with that process's last log line as the reason
        (on the run page and in the API); its data stays."""
        for run_id, group in list(self.groups.items()):
            gave_up = group.gave_up()
            if not gave_up:
                continue
            first = gave_up[0]
            reason = (
                f"{first.name.removeprefix(run_prefix(run_id))} on {self.name} failed at start "
                f"{first.failed_starts} times in a row (exit {first.exit_code}): "
                f"{first.last_line or 'its log is empty'} (log: {first.log})"
            )
            self._stop_group(run_id)
            placement = RunPlacement.objects.filter(run_id=run_id).first()
            if placement is not None:
                placement_set(placement_id=placement.pk, state=PlacementState.ENDED, reason=reason)
            run_fail(run_id=run_id, message=reason)
            log.error("run %s failed: %s", run_id, reason)

    def _fail(self, placement: RunPlacement, reason: str) -> None:
        placement_set(placement_id=placement.pk, state=PlacementState.ENDED, reason=reason)
        run_fail_queued(run_id=placement.run_id, message=reason)


def _router_up(url: str) -> bool:
    try:
        with RouterAdmin(url, timeout=2, token=settings.DARTBOARD_ADMIN_TOKEN) as admin:
            return any(w.status == WorkerStatus.ACTIVE for w in admin.workers())
    except Exception:
        return False
