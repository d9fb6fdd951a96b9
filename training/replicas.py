"""Data-parallel replicas of the policy update: N processes (one per GPU, `torchrun`), each
holding the whole model, deal an update's micro-batches round-robin and sum their gradients
before every optimizer step, so the N replicas take exactly the step one process would
(up to float summation order) and stay identical.

Why summing is exact: `training.update` normalises every micro-batch's loss by the whole
optimizer step's token / sequence / trajectory counts, so the step's gradient is the sum of
the micro-batches' gradients, wherever they were computed. The pi_old pass is dealt the same
way and its per-step statistics are gathered, so every replica sees all of them.

    torch.distributed.init_process_group("nccl")         # or "gloo" on CPUs
    replicas = Replicas.from_environment()               # rank and world from torchrun
    trainer = PolicyTrainer(..., replicas=replicas)       # every rank; rank 0 saves versions

Pure torch.distributed: no Django, no model code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


def collective_device() -> torch.device:
    """Where a collective's tensors must live: NCCL moves only CUDA tensors (the process's
    current device, `training.replica_group.GroupSetup`), gloo CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Replicas:
    """This process's place among `world` replicas; torch.distributed is initialised."""

    rank: int
    world: int
    sharded: bool = False  # FSDP2 (`training.sharding`): replicas run forward passes in lockstep
    one_host: bool = True  # every replica on the leader's host (batches go as files)
    # Messages shared so far (a one-item list: the dataclass is frozen, the count is not).
    _shared: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    @classmethod
    def from_environment(cls, *, sharded: bool = False, one_host: bool = True) -> Replicas:
        if not dist.is_initialized():
            raise RuntimeError("Replicas need torch.distributed.init_process_group() first")
        return cls(
            rank=dist.get_rank(), world=dist.get_world_size(), sharded=sharded, one_host=one_host
        )

    @property
    def leader(self) -> bool:
        """Rank 0 reads batches, records updates and saves versions."""
        return self.rank == 0

    def align(self, params: Sequence[nn.Parameter]) -> None:
        """Give every replica the leader's values (fresh LoRA adapters start random)."""
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=0)

    def mine(self, items: Sequence[T]) -> list[T]:
        """This replica's share of `items`, dealt round-robin."""
        return list(items[self.rank :: self.world])

    def deal(self, micros: Sequence[T]) -> list[tuple[T, bool]]:
        """This replica's micro-batches, each with whether it counts. Sharded replicas gather
        weights together, so each runs the same number of passes: a replica short of work
        repeats the first micro-batch as a pass that does not count (its loss times 0)."""
        mine = [(m, True) for m in self.mine(micros)]
        if self.sharded and micros:
            mine += [(micros[0], False)] * (-(-len(micros) // self.world) - len(mine))
        return mine

    def sum_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """All-reduce (sum) the gradients of `params`, flattened into one buffer. A replica
        with no micro-batch in this step contributes zeros. Sharded replicas' gradient shards
        were already averaged by FSDP's reduce-scatter: times N, they are the sum."""
        if self.sharded:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(self.world)
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        tensor = torch.tensor(list(values), dtype=torch.float64, device=collective_device())
        dist.all_reduce(tensor)
        return tensor.cpu().tolist()

    def merge(self, part: dict[Any, Any]) -> dict[Any, Any]:
        """Every replica's dict, merged (keys are disjoint: each replica filled its share)."""
        gathered: list[dict[Any, Any] | None] = [None] * self.world
        dist.all_gather_object(gathered, part)
        merged: dict[Any, Any] = {}
        for piece in gathered:
            merged.update(piece or {})
        return merged

    def share(self, value: T) -> T:
        """The leader's `value` on every replica (what to train on, and with which config).
        The leader first posts that a message is coming (`await_leader`)."""
        number = self._shared[0] = self._shared[0] + 1
        if self.leader:
            _store().set(f"{_MESSAGE}{number}", "1")
        box = [value if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def await_leader(self, poll_s: float = 30.0) -> None:
        """A follower's wait for the leader's next `share`, on the group's key-value store
        rather than in a collective: a collective waiting for the first batch of a run (an
        hour of OSWorld episodes and the version-0 evaluation) would outlast its timeout
        (NCCL's 10 minutes) and abort the follower. Returns when the message is posted; the
        follower dies with the leader's process meanwhile (`replica_group`), or, on another
        host, raises `DistNetworkError` when the leader's store goes."""
        key = f"{_MESSAGE}{self._shared[0] + 1}"
        store = _store()
        while True:
            try:
                store.wait([key], timedelta(seconds=poll_s))
                return
            except dist.DistNetworkError:  # the leader's store is gone: so is the leader
                raise
            except (RuntimeError, dist.DistStoreError):  # not posted yet: wait on
                continue


_MESSAGE = "dartboard/replica-message/"


def _store() -> dist.Store:
    """The process group's key-value store (the rendezvous's TCPStore)."""
    return dist.distributed_c10d._get_default_store()
