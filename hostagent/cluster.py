"""One run's processes over the cluster's hosts, all or nothing, or why the run waits.

Every host agent reports its host (GPUs, CPU inference and trainer slots, env kinds, cluster
address); any agent places a queued run over all the hosts that report
(`place_cluster`): on one host when one takes the whole run (`hostagent.placement.place`,
the run's processes as on a single machine), otherwise split: the trainer's replicas on GPU
hosts (as few as hold them), the inference workers on the GPUs left (the trainer's hosts
first), the env workers on hosts that run the run's env kinds (hosts without GPUs first).
Nothing starts until the whole run fits; the reason names what is missing on each host:
"needs 16 GPUs with 60 GiB free for the trainer: 8 free on gpu-1, 4 on gpu-2".

Each host's agent starts its own part (`Placement`); the router runs beside the first
inference worker and reaches the others at their hosts' addresses; trainer replicas on
several hosts meet at the leader's rendezvous (its host's address, the last port of its
block), where torch.distributed forms their group (`training.replica_group`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from hostagent.placement import (
    PORTS_PER_RUN,
    HostInventory,
    Placement,
    RunNeeds,
    _free_gib,
    place,
    port_block,
)
from training.memory_plan import DoesNotFit


@dataclass
class ClusterPlacement:
    """Where one run's processes go: a part per host (`Placement`)."""

    parts: list[Placement]

    def part(self, host: str) -> Placement | None:
        return next((p for p in self.parts if p.host == host), None)

    @property
    def lead(self) -> Placement:
        """The host that answers for the run: the router's, else the trainer leader's."""
        for p in self.parts:
            if p.router and p.worker_ports:
                return p
        for p in self.parts:
            if 0 in p.trainer_ranks or p.whole:
                return p
        return self.parts[0]

    @property
    def router_url(self) -> str:
        lead = self.lead
        return f"http://{lead.address}:{lead.router_port}" if lead.worker_ports else ""

    @property
    def hosts(self) -> list[str]:
        return [p.host for p in self.parts]

    def to_dict(self) -> dict:
        """As stored: one host's whole run as that host's `Placement`, a run over several
        hosts as its parts."""
        if len(self.parts) == 1 and self.parts[0].whole:
            return self.parts[0].to_dict()
        return {"parts": [p.to_dict() for p in self.parts]}

    @classmethod
    def from_dict(cls, data: dict) -> ClusterPlacement:
        if "parts" in data:
            return cls([Placement.from_dict(p) for p in data["parts"]])
        return cls([Placement.from_dict(data)])


_Taken = dict[str, list[Placement]]  # host -> the parts of runs placed there
_FreeGib = dict[str, dict[int, float]]  # host -> GPU index -> GiB free


class _Parts:
    """The parts of a run being split, one per host, made on first use."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._parts: dict[str, Placement] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def of(self, host: HostInventory) -> Placement:
        if host.name not in self._parts:
            self._parts[host.name] = Placement(
                host=host.name, device=self.device, whole=False, address=host.address
            )
        return self._parts[host.name]

    def all(self) -> list[Placement]:
        return list(self._parts.values())


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _free_list(free: dict[str, int], unit: str = "free") -> str:
    return ", ".join(f"{n} {unit} on {name}" for name, n in free.items())


def place_cluster(
    needs: RunNeeds,
    hosts: Sequence[HostInventory],
    *,
    taken: dict[str, list[Placement]],
    port_bases: dict[str, int],
    env_kinds: set[str],
    env_workers: int,
) -> ClusterPlacement | str:
    """The run's placement over `hosts` beside the parts in `taken` (host -> the parts of
    runs already placed there), or why it must wait. `env_kinds`: the kinds of the run's env
    slots, `env_workers`: how many (one per slot)."""
    if not hosts:
        return "no host agent reports"
    device = needs.device
    if device == "auto":
        device = "cuda" if any(h.gpus for h in hosts) else "cpu"
    needs = dataclasses.replace(needs, device=device)
    reasons: dict[str, str] = {}
    for host in hosts:
        here = taken.get(host.name, [])
        reason = _host_cannot(needs, host, here, env_kinds=env_kinds, env_workers=env_workers)
        plan = reason or place(needs, host, taken=here, port_base=port_bases[host.name])
        if isinstance(plan, str):
            reasons[host.name] = plan
            continue
        plan.address = host.address
        plan.env_workers = env_workers
        plan.trainer_ranks = list(range(needs.trainer_replicas))
        plan.trainer_world = needs.trainer_replicas
        plan.trainer_shard = needs.shard
        return ClusterPlacement([plan])
    if len(hosts) == 1:
        return reasons[hosts[0].name]
    return _split(
        needs,
        hosts,
        taken=taken,
        port_bases=port_bases,
        env_kinds=env_kinds,
        env_workers=env_workers,
    )


def _host_cannot(
    needs: RunNeeds,
    host: HostInventory,
    here: list[Placement],
    *,
    env_kinds: set[str],
    env_workers: int,
) -> str | None:
    """Why `host` cannot take the whole run, beyond its GPUs and inference slots."""
    missing = env_kinds - set(host.env_kinds)
    if env_workers and missing:
        return f"needs env kinds {sorted(missing)}, which {host.name} cannot run"
    if host.env_slots is not None:
        free = host.env_slots - sum(p.env_workers for p in here)
        if env_workers > free:
            return f"needs {_plural(env_workers, 'env worker')}; {max(free, 0)} free on {host.name}"
    if needs.device == "cpu" and host.cpu_trainer_slots is not None:
        free = host.cpu_trainer_slots - sum(len(p.trainer_ranks) for p in here)
        if needs.trainer_replicas > free:
            return (
                f"needs {_plural(needs.trainer_replicas, 'CPU trainer replica')}; "
                f"{max(free, 0)} free on {host.name}"
            )
    return None


def _split(
    needs: RunNeeds,
    hosts: Sequence[HostInventory],
    *,
    taken: dict[str, list[Placement]],
    port_bases: dict[str, int],
    env_kinds: set[str],
    env_workers: int,
) -> ClusterPlacement | str:
    """The run spread over several hosts (module doc), or why it cannot be."""
    parts = _Parts(needs.device)
    free_gib = {h.name: _free_gib(h, taken.get(h.name, [])) for h in hosts}
    gpu = needs.device == "cuda"
    usable = [h for h in hosts if h.gpus and h.cuda_torch] if gpu else list(hosts)
    if gpu and not usable:
        return "needs GPUs (device cuda); no host that reports has GPUs its torch can use"

    # The trainer's replicas: on as few hosts as hold them.
    reason = (_gpu_trainer if gpu else _cpu_trainer)(needs, usable, taken, free_gib, parts)
    if reason:
        return reason
    # The inference workers: the trainer's hosts first.
    ordered = [h for h in usable if h.name in parts] + [h for h in usable if h.name not in parts]
    reason = (_gpu_inference if gpu else _cpu_inference)(needs, ordered, taken, free_gib, parts)
    if reason:
        return reason
    # The env workers: hosts without GPUs first (they are what env hosts are for).
    if env_workers:
        able = [h for h in hosts if env_kinds <= set(h.env_kinds)]
        if not able:
            offered = "; ".join(f"{h.name}: {', '.join(h.env_kinds) or 'none'}" for h in hosts)
            return (
                f"needs env kinds {sorted(env_kinds)} on one host; none runs them all ({offered})"
            )
        able.sort(key=lambda h: (bool(h.gpus), h.name not in parts, h.name))
        left = env_workers
        free_slots: dict[str, int] = {}
        for h in able:
            used = sum(p.env_workers for p in taken.get(h.name, []))
            room = left if h.env_slots is None else max(h.env_slots - used, 0)
            free_slots[h.name] = room
            n = min(room, left)
            if n:
                parts.of(h).env_workers = n
                left -= n
        if left:
            return (
                f"needs {_plural(env_workers, 'env worker')} for {sorted(env_kinds)}: "
                f"{_free_list(free_slots)} (DARTBOARD_ENV_SLOTS)"
            )
    return _number_and_ports(needs, parts.all(), taken, port_bases)


def _gpu_trainer(
    needs: RunNeeds,
    hosts: Sequence[HostInventory],
    taken: _Taken,
    free_gib: _FreeGib,
    parts: _Parts,
) -> str | None:
    want = needs.trainer_replicas
    if not want:
        return None
    options: list[tuple[HostInventory, float, list[int]]] = []
    gib_seen, last = 0.0, ""
    for h in hosts:
        try:
            gib = needs.trainer_gib(max(g.memory_gib for g in h.gpus))
        except DoesNotFit as exc:
            options.append((h, 0.0, []))
            last = str(exc)
            continue
        gib_seen = max(gib_seen, gib)
        free = free_gib[h.name]
        fits = sorted((i for i in free if free[i] >= gib), key=lambda i: (-free[i], i))
        options.append((h, gib, fits))
    if not gib_seen:
        return last
    options.sort(key=lambda o: -len(o[2]))
    rank = 0
    for h, gib, fits in options:
        for i in fits:
            if rank == want:
                break
            p = parts.of(h)
            p.trainer_gpus.append(i)
            p.trainer_ranks.append(rank)
            free_gib[h.name][i] -= gib
            p.gpu_gib[str(i)] = round(p.gpu_gib.get(str(i), 0.0) + gib, 2)
            rank += 1
    if rank < want:
        counts = {h.name: len(fits) for h, _, fits in options}
        return (
            f"needs {_plural(want, 'GPU')} with {gib_seen:.0f} GiB free for the trainer: "
            f"{_free_list(counts)}"
        )
    return None


def _cpu_trainer(
    needs: RunNeeds,
    hosts: Sequence[HostInventory],
    taken: _Taken,
    free_gib: _FreeGib,
    parts: _Parts,
) -> str | None:
    want = needs.trainer_replicas
    if not want:
        return None
    room: dict[str, int] = {}
    for h in hosts:
        used = sum(len(p.trainer_ranks) for p in taken.get(h.name, []))
        room[h.name] = want if h.cpu_trainer_slots is None else max(h.cpu_trainer_slots - used, 0)
    rank = 0
    for h in sorted(hosts, key=lambda h: (-room[h.name], h.name)):
        for _ in range(min(room[h.name], want - rank)):
            parts.of(h).trainer_ranks.append(rank)
            rank += 1
    if rank < want:
        return (
            f"needs {_plural(want, 'CPU trainer replica')}: {_free_list(room)} "
            "(DARTBOARD_CPU_TRAINER_SLOTS)"
        )
    return None


def _gpu_inference(
    needs: RunNeeds,
    hosts: Sequence[HostInventory],
    taken: _Taken,
    free_gib: _FreeGib,
    parts: _Parts,
) -> str | None:
    want = needs.inference_workers
    placed = 0
    roomy: dict[str, int] = {}
    shared = needs.backend == "vllm" and needs.vllm_gpus == "shared"
    for h in hosts:
        gpus = {g.index: g for g in h.gpus}
        free = free_gib[h.name]
        mine = set(parts.of(h).trainer_gpus) if h.name in parts else set()
        pool = sorted(mine) if shared else [i for i in sorted(free) if i not in mine]
        roomy[h.name] = sum(1 for i in pool if free[i] >= needs.inference_gib(gpus[i]))
        for i in pool:
            if placed == want:
                break
            gib = needs.inference_gib(gpus[i])
            if free[i] >= gib:
                free[i] -= gib
                p = parts.of(h)
                p.inference_gpus.append(i)
                p.gpu_gib[str(i)] = round(p.gpu_gib.get(str(i), 0.0) + gib, 2)
                placed += 1
    if placed < want:
        gib = needs.inference_gib(hosts[0].gpus[0]) if hosts and hosts[0].gpus else 0.0
        return (
            f"needs {_plural(want, 'GPU')} with {gib:.0f} GiB free for inference (after the "
            f"trainer's): {_free_list(roomy)}"
        )
    return None


def _cpu_inference(
    needs: RunNeeds,
    hosts: Sequence[HostInventory],
    taken: _Taken,
    free_gib: _FreeGib,
    parts: _Parts,
) -> str | None:
    want = needs.inference_workers
    room: dict[str, int] = {}
    for h in hosts:
        busy = sum(p.cpu_inference for p in taken.get(h.name, []))
        room[h.name] = max(h.cpu_inference_slots - busy, 0)
    placed = 0
    for h in hosts:
        for _ in range(min(room[h.name], want - placed)):
            parts.of(h).inference_gpus.append(None)
            placed += 1
    if placed < want:
        return (
            f"needs {_plural(want, 'CPU inference worker')}: {_free_list(room)} "
            "(DARTBOARD_CPU_INFERENCE_SLOTS)"
        )
    return None


def _number_and_ports(
    needs: RunNeeds,
    parts: list[Placement],
    taken: dict[str, list[Placement]],
    port_bases: dict[str, int],
) -> ClusterPlacement:
    """Number the env and inference workers across the parts, give each part that serves
    a port block, put the router beside inference worker 0 and the trainer's rendezvous on
    its leader's block."""
    env_first = inference_first = 0
    spans = sum(1 for p in parts if p.trainer_ranks) > 1
    for p in parts:
        p.env_first, env_first = env_first, env_first + p.env_workers
        p.inference_first, inference_first = (
            inference_first,
            inference_first + len(p.inference_gpus),
        )
        p.router = False
        p.trainer_world = needs.trainer_replicas if p.trainer_ranks else 0
        p.trainer_shard = needs.shard and bool(p.trainer_ranks)
        if p.inference_gpus or (spans and 0 in p.trainer_ranks):
            p.router_port, p.worker_ports = port_block(
                len(p.inference_gpus), base=port_bases[p.host], taken=taken.get(p.host, [])
            )
    serving = [p for p in parts if p.inference_gpus]
    if serving:
        serving[0].router = True
        serving[0].router_workers = [
            f"http://{p.address}:{port}" for p in serving for port in p.worker_ports
        ]
    if spans:
        leader = next(p for p in parts if 0 in p.trainer_ranks)
        rendezvous = f"{leader.address}:{leader.router_port + PORTS_PER_RUN - 1}"
        for p in parts:
            if p.trainer_ranks:
                p.rendezvous = rendezvous
    return ClusterPlacement(parts)
