"""Start a run's data-parallel trainer replicas: this process is rank 0 (the leader, which
reads batches, records updates and saves versions) and N-1 follower processes build the same
trainer and take every update with it.

On one host the leader starts its followers (`python -m training.replica_group SPEC`) with
the environment torchrun gives its workers (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK,
WORLD_SIZE); rank r uses GPU r; on CPUs they use gloo on the loopback device. They die with
the leader's process. An update's batch reaches them as a file on this host
(`core.samples.samples_write`), the collective carrying only its name, the curation settings
and the update count (the learning rate's schedule follows it).

Over several hosts (`rendezvous`, from the run's placement) the leader's store listens at
its host's cluster address and the followers are the hosts' own processes
(`workers.trainer_rank`, started by their host agents with the same environment), which
read the trainer's settings from the store (`join`); the batch travels in the collective.
The group is torch.distributed's own: NCCL on GPUs, gloo on CPUs, every collective bounded
by the run's `trainer.replica_timeout_s`.

Between updates the followers wait on the group's key-value store, outside any collective
(`Replicas.await_leader`).

    group = ReplicaGroup.start(spec, world=4)     # in the trainer worker
    trainer = group.trainer                       # PolicyTrainer(replicas=...), rank 0
    trainer.update(samples, curation)             # every replica takes this step
    group.close()
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from core.procutil import die_with_parent, terminate_pid
from core.samples import samples_read
from training.config import TrainerConfig
from training.memory_plan import Sample
from training.replicas import Replicas
from training.trainer import PolicyTrainer

log = logging.getLogger("dartboard.trainer")
STOP = ("stop",)
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)  # followers starting: imports and a model load
# Over several hosts: the groups the leader formed so far (a counter), the one open for
# followers to join (its number), and in each group the leader's TrainerSpec and how many
# followers arrived.
GROUPS_KEY = "dartboard/groups"
OPEN_KEY = "dartboard/open-group"
GROUP_PREFIX = "dartboard/group-"
SPEC_KEY = "trainer-spec"
ARRIVED_KEY = "arrived"
_STORES: dict[str, dist.TCPStore] = {}  # the leader's rendezvous store, by host:port


def _rendezvous_store(rendezvous: str, *, gloo: bool) -> dist.TCPStore:
    """This process's store at `rendezvous`, made on first use and kept: the run's port is
    fixed, and a store's server lives as long as anything still holds it (a failed
    group's traceback, say), so a second one on that port could not listen."""
    store = _STORES.get(rendezvous)
    if store is None:
        host, port = rendezvous.rsplit(":", 1)
        if gloo:
            reach_peers_from(host)
        store = dist.TCPStore(
            host, int(port), is_master=True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False
        )
        _STORES[rendezvous] = store
    return store


def _await_arrivals(store: dist.Store, followers: int) -> None:
    """Until `followers` followers have read the spec and built their trainer (imports and
    a model load: minutes on a loaded host), before the process group's own timeout
    starts."""
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    while store.add(ARRIVED_KEY, 0) < followers:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{store.add(ARRIVED_KEY, 0)} of {followers} trainer replicas on other hosts "
                f"joined within {RENDEZVOUS_TIMEOUT.total_seconds():.0f} s: read their logs "
                "(dartboard run logs)"
            )
        time.sleep(0.5)


@dataclass(frozen=True)
class TrainerSpec:
    """Everything a replica needs to build the same PolicyTrainer: the run's trainer settings
    as they are, and where its weights start and go."""

    config: TrainerConfig
    start_checkpoint: str
    run_dir: str
    published_versions: list[int] = field(default_factory=list)
    sample: Sample | None = None  # the largest step the run's budgets allow (memory plan)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainerSpec:
        data = json.loads(text)
        sample = Sample(**data["sample"]) if data.get("sample") else None
        return cls(**{**data, "config": TrainerConfig(**data["config"]), "sample": sample})

    def build(self, replicas: Replicas | None, *, device: str) -> PolicyTrainer:
        return PolicyTrainer(
            config=self.config,
            start_checkpoint=Path(self.start_checkpoint),
            run_dir=Path(self.run_dir),
            device=device,
            published_versions=self.published_versions,
            replicas=replicas,
            sample=self.sample,
        )


@dataclass(frozen=True)
class GroupSetup:
    """How one replica process joins the group: the backend, and the device its trainer,
    its FSDP mesh and its collectives use (NCCL takes the process's current CUDA device,
    so a replica that never sets it works on GPU 0 whatever its rank)."""

    backend: str
    device: str

    def apply(self) -> dict[str, Any]:
        """Make `device` current; init_process_group's keyword arguments binding it."""
        if not self.device.startswith("cuda"):
            return {}
        torch.cuda.set_device(torch.device(self.device))
        return {"device_id": torch.device(self.device)}

    def join(self, store: dist.Store, *, rank: int, world: int, timeout_s: float) -> None:
        """Form the process group at `store` as `rank` of `world`, every collective bounded
        by `timeout_s` (the run's `trainer.replica_timeout_s`)."""
        dist.init_process_group(
            self.backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            **self.apply(),
        )


def reach_peers_from(address: str) -> None:
    """Make gloo talk to the group's other hosts from the interface holding `address`
    (this host's cluster address): left to itself, gloo binds to what this host's name
    resolves to, the loopback on many machines, and its peers on other hosts are refused.
    NCCL finds its interfaces itself."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return
    raise RuntimeError(f"no network interface of this host has the address {address}")


def address_towards(host: str, port: int) -> str:
    """This host's address on the route to host:port (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def group_setup(*, local_rank: int, cuda: bool) -> GroupSetup:
    """Replica `local_rank` of this host: GPU `local_rank` on NCCL, or the CPU on gloo."""
    if cuda:
        return GroupSetup(backend="nccl", device=f"cuda:{local_rank}")
    return GroupSetup(backend="gloo", device="cpu")


class ReplicaGroup:
    """The leader's handle on the followers and the process group."""

    def __init__(self, trainer: PolicyTrainer, followers: list[subprocess.Popen]) -> None:
        self.trainer = trainer
        self.followers = followers
        self.rendezvous: dist.TCPStore | None = None  # replicas on other hosts join there

    @classmethod
    def start(
        cls,
        spec: TrainerSpec,
        *,
        world: int,
        timeout_s: float | None = None,
        rendezvous: str = "",
    ) -> ReplicaGroup:
        """Start world-1 followers (or, with `rendezvous` "host:port", wait there for the
        followers other hosts start), join them as rank 0 and build the leader's trainer.
        `timeout_s` (default: the run's `trainer.replica_timeout_s`) bounds each collective
        once every replica is in it; between updates the followers wait outside any
        collective, however long the leader takes to have a batch."""
        if world < 2:
            raise ValueError(f"a replica group needs at least 2 processes, got {world}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group")
        timeout_s = timeout_s or spec.config.replica_timeout_s
        if rendezvous:
            return cls._lead(spec, world=world, timeout_s=timeout_s, rendezvous=rendezvous)
        with socket.socket() as s:  # the rendezvous listens on the loopback only
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world),
            "GLOO_SOCKET_IFNAME": "lo",
            "DARTBOARD_REPLICA_TIMEOUT_S": str(timeout_s),
        }
        setup = group_setup(local_rank=0, cuda=torch.cuda.is_available())
        if setup.backend == "gloo":
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        followers = [
            subprocess.Popen(
                [sys.executable, "-m", "training.replica_group", spec.to_json()],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                preexec_fn=die_with_parent,
            )
            for rank in range(1, world)
        ]
        try:
            # The rendezvous waits as long as followers take to start (importing torch and
            # loading a model); `timeout_s` bounds the collectives once all are in.
            store = dist.TCPStore(
                "127.0.0.1", port, world, is_master=True, timeout=RENDEZVOUS_TIMEOUT
            )
            setup.join(store, rank=0, world=world, timeout_s=timeout_s)
            trainer = spec.build(
                Replicas(rank=0, world=world, sharded=spec.config.shard == "on"),
                device=setup.device,
            )
        except BaseException:
            for proc in followers:
                terminate_pid(proc.pid, timeout=10)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        return cls(trainer, followers)

    @classmethod
    def _lead(
        cls, spec: TrainerSpec, *, world: int, timeout_s: float, rendezvous: str
    ) -> ReplicaGroup:
        """Rank 0 of replicas on several hosts: the store at `rendezvous` (this host's
        cluster address; one for the life of this process, since its port is the run's),
        a numbered group in it, the spec posted there for the followers to read, the
        process group formed once all `world` ranks have arrived."""
        setup = group_setup(local_rank=0, cuda=torch.cuda.is_available())
        store = _rendezvous_store(rendezvous, gloo=setup.backend == "gloo")
        prefix = f"{GROUP_PREFIX}{store.add(GROUPS_KEY, 1)}/"
        group_store = dist.PrefixStore(prefix, store)
        try:
            group_store.set(SPEC_KEY, spec.to_json())
            store.set(OPEN_KEY, prefix)
            _await_arrivals(group_store, world - 1)
            setup.join(group_store, rank=0, world=world, timeout_s=timeout_s)
            replicas = Replicas(
                rank=0, world=world, sharded=spec.config.shard == "on", one_host=False
            )
            trainer = spec.build(replicas, device=setup.device)
        except BaseException:
            store.delete_key(OPEN_KEY)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        group = cls(trainer, [])
        group.rendezvous = store
        return group

    def close(self, timeout_s: float = 60.0) -> None:
        """Tell the followers to stop, leave the group and reap them. After a failed update
        the group may be broken: the followers are then terminated, and the process group is
        left anyway, so this worker can start a new group."""
        try:
            if dist.is_initialized():
                assert self.trainer.replicas is not None
                try:
                    self.trainer.replicas.share(STOP)
                except Exception as exc:  # they are terminated below; the update's error stands
                    log.warning("could not tell the trainer replicas to stop: %s", exc)
                    timeout_s = 0.0
        finally:
            if self.rendezvous is not None:  # no follower joins this group any more
                self.rendezvous.delete_key(OPEN_KEY)
            if dist.is_initialized():
                dist.destroy_process_group()
            for proc in self.followers:
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    terminate_pid(proc.pid, timeout=10)
                    proc.wait()


def join(*, spec_for: Callable[[TrainerSpec], TrainerSpec] = lambda spec: spec) -> None:
    """A follower on another host than its leader (`workers.trainer_rank`): the leader's
    store at MASTER_ADDR:MASTER_PORT, the group open there, the trainer's settings read from
    it (`spec_for` makes them this host's: its own copy of the run's directory), then
    `follow`. Returns when the leader closes the group; raises when the leader or the
    network is gone, or when the group it found closed before it arrived."""
    world = int(os.environ["WORLD_SIZE"])
    leader, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if not torch.cuda.is_available():  # gloo
        reach_peers_from(address_towards(leader, port))
    store = dist.TCPStore(leader, port, world, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
    store.wait([OPEN_KEY], RENDEZVOUS_TIMEOUT)
    prefix = store.get(OPEN_KEY).decode()
    group_store = dist.PrefixStore(prefix, store)
    spec = spec_for(TrainerSpec.from_json(group_store.get(SPEC_KEY).decode()))
    group_store.add(ARRIVED_KEY, 1)
    follow(spec, store=group_store, one_host=False)


def follow(spec: TrainerSpec, *, store: dist.Store | None = None, one_host: bool = True) -> None:
    """A follower's life: build the trainer, take every update the leader shares, stop."""
    setup = group_setup(local_rank=int(os.environ["LOCAL_RANK"]), cuda=torch.cuda.is_available())
    timeout = timedelta(
        seconds=float(
            os.environ.get("DARTBOARD_REPLICA_TIMEOUT_S") or spec.config.replica_timeout_s
        )
    )
    world = int(os.environ["WORLD_SIZE"])
    if store is None:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=RENDEZVOUS_TIMEOUT,
        )
    setup.join(store, rank=int(os.environ["RANK"]), world=world, timeout_s=timeout.total_seconds())
    replicas = Replicas.from_environment(sharded=spec.config.shard == "on", one_host=one_host)
    torch.set_num_threads(1)
    try:
        trainer = spec.build(replicas, device=setup.device)
        while True:
            replicas.await_leader()  # outside any collective: the first batch may take hours
            message: tuple[Any, ...] = replicas.share(STOP)  # the leader's value replaces it
            if message == STOP:
                return
            if message[0] == "save":  # the leader writes; a follower gives its shards
                trainer.full_state()
                trainer.state.version = message[1]
                continue
            # The leader's batch (a file on this host, or the samples themselves from
            # another host), and its update count (the schedule's).
            _, batch, curation, behaviour_cloning, trainer.state.updates = message
            samples = samples_read(Path(batch)) if isinstance(batch, str) else batch
            trainer.update(samples, curation, behaviour_cloning=behaviour_cloning)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # `python -m training.replica_group SPEC` (a child of its leader) or `... join` (a
    # follower on another host, its settings from the leader's store as they are).
    if sys.argv[1:] == ["join"]:
        join()
    else:
        follow(TrainerSpec.from_json(sys.argv[1]))
    # Leave without the interpreter's teardown: after a sharded run it sometimes met a torch
    # thread still joinable and aborted ("terminate called without an active exception",
    # exit -6 in CI) although the follower's work was done and its group left.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
