"""Where a run's processes go on a host, or why they cannot go there yet.

A run asks for inference workers (backend, count), a trainer (replicas) and a device. A host
has GPUs (with their memory), CPU inference slots, and the runs already placed on it. `place`
returns a `Placement` (which GPU each trainer replica and each inference worker takes, and
the ports of the run's router and workers), or the reason the run waits, in the words the
run's page shows: "needs 4 GPUs with 40 GiB free; 2 are free on gpu-host-1".

The memory a trainer replica needs is `training.memory_plan`'s plan from the checkpoint's
config and the run's budgets, for the host's largest GPU, where the config is on this host;
otherwise an estimate from its checkpoint's size on disk (`checkpoint_gib`, as bf16): the
trainer holds the bf16 weights and its activations under
LoRA, or fp32 weights, gradients and AdamW's two moments plus a bf16 reference (9x the bf16
weights, divided over FSDP2 shards) and its activations under full fine-tuning; a
transformers inference worker holds the bf16 weights and a cache; vLLM takes its configured
fraction of the GPU. It decides what can start; `bench/realsize.py` is the measured plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollout.limits import MAX_BATCH
from training.memory_plan import HEADROOM_GIB, DoesNotFit, TrainerRequest, inference_bytes

GIB = 1024**3
ACTIVATION_GIB = 8.0  # a real-size micro-batch's activations under checkpointing (realsize)
PORTS_PER_RUN = 18  # the router, up to 16 inference workers, the trainer's rendezvous


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_gib: float


@dataclass(frozen=True)
class HostInventory:
    """What a host has: from its agent's report (`hostagent.agent.host_inventory`)."""

    name: str
    gpus: tuple[Gpu, ...] = ()
    cuda_torch: bool = False
    cpu_inference_slots: int = 2
    address: str = "127.0.0.1"  # where the cluster's other hosts reach it
    env_kinds: tuple[str, ...] = ()
    cpu_trainer_slots: int | None = None  # CPU trainer replicas it takes at once; None: any
    env_slots: int | None = None  # env workers it runs at once; None: any


@dataclass(frozen=True)
class RunNeeds:
    """What a run asks for (`run_needs` reads it from the run's config)."""

    inference_workers: int  # 0: the scripted oracle
    backend: str
    trainer_replicas: int  # 0: nothing to train
    device: str  # auto, cpu, cuda
    vllm_gpus: str = "after_trainer"
    vllm_gpu_memory: float = 0.9
    weights_gib: float = 0.0  # the weights in bf16
    lora: bool = True
    shard: bool = False
    trainer: TrainerRequest | None = None  # the memory plan's input, where the config is here

    def trainer_gib(self, gpu_gib: float) -> float:
        """GiB of a `gpu_gib` GPU one trainer replica takes: the memory plan's peak and the
        CUDA context (`training.memory_plan`, its `auto` settings picked for that GPU), or,
        without the checkpoint's config on this host, an estimate from the weights' size.

        Raises:
            DoesNotFit: the plan fits no such GPU.
        """
        if self.trainer is not None:
            return self.trainer.plan(gpu_gib).total / GIB + HEADROOM_GIB
        if self.lora:  # bf16 weights; adapters and their optimizer state are small
            return self.weights_gib + ACTIVATION_GIB
        shards = self.trainer_replicas if self.shard else 1
        # fp32 master weights, gradients, two AdamW moments (4 x 2 bytes per bf16 byte)
        # and a bf16 reference copy
        return self.weights_gib * 9 / shards + ACTIVATION_GIB

    def inference_gib(self, gpu: Gpu) -> float:
        """GiB of `gpu` one inference worker takes: vLLM its configured share; the
        transformers server the memory plan's weights and the KV cache of a full batch at
        the run's context (`training.memory_plan.inference_bytes`) and the CUDA context, or
        without the checkpoint's config here, the weights and 2 GiB."""
        if self.backend == "vllm":
            return gpu.memory_gib * self.vllm_gpu_memory
        if self.trainer is not None:
            held = inference_bytes(
                self.trainer.shape, context_tokens=self.trainer.sample.tokens, sequences=MAX_BATCH
            )
            return held / GIB + HEADROOM_GIB
        return self.weights_gib + 2.0  # bf16 weights and a KV cache


@dataclass
class Placement:
    """Where one run's processes go on one host. `inference_gpus[i]` is this host's worker
    i's GPU (None: the CPU).

    `whole`: the host runs the whole run (every env worker, every trainer replica, the router
    and its workers), as `place` decides; otherwise it is one host's part of a run spread over
    several (`hostagent.cluster`): `env_workers` env workers numbered from `env_first`, the
    trainer's global ranks `trainer_ranks` (rank 0, the leader, in the Celery train worker;
    the others join its group at `rendezvous`), inference workers numbered from
    `inference_first`, and the router where `router` is set (its workers' URLs in
    `router_workers`)."""

    host: str
    device: str  # cpu or cuda
    trainer_gpus: list[int] = field(default_factory=list)
    inference_gpus: list[int | None] = field(default_factory=list)
    router_port: int = 0  # the first port of the run's block on this host
    worker_ports: list[int] = field(default_factory=list)
    gpu_gib: dict[str, float] = field(default_factory=dict)  # GPU index -> GiB this run takes
    whole: bool = True
    address: str = "127.0.0.1"
    env_workers: int = 0
    env_first: int = 0
    trainer_ranks: list[int] = field(default_factory=list)
    trainer_world: int = 0
    trainer_shard: bool = False  # FSDP2 over the trainer's replicas
    rendezvous: str = ""  # host:port of the trainer leader's store, where ranks span hosts
    inference_first: int = 0
    router: bool = True
    router_workers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Placement:
        return cls(**data)

    @property
    def cpu_inference(self) -> int:
        return sum(1 for gpu in self.inference_gpus if gpu is None)


def _free_gib(host: HostInventory, taken: list[Placement]) -> dict[int, float]:
    free = {gpu.index: gpu.memory_gib for gpu in host.gpus}
    for placement in taken:
        for index, gib in placement.gpu_gib.items():
            if int(index) in free:
                free[int(index)] -= gib
    return free


def port_block(count: int, *, base: int, taken: list[Placement]) -> tuple[int, list[int]]:
    """The first block of ports after `base` no placed run uses: (router, workers)."""
    used = {p.router_port for p in taken}
    start = base
    while start in used:
        start += PORTS_PER_RUN
    return start, [start + 1 + i for i in range(count)]


def place(
    needs: RunNeeds, host: HostInventory, *, taken: list[Placement], port_base: int
) -> Placement | str:
    """The run's placement on `host` beside the runs in `taken`, or why it must wait."""
    gpu_run = needs.device == "cuda" or (needs.device == "auto" and bool(host.gpus))
    if not gpu_run:
        busy = sum(p.cpu_inference for p in taken)
        slots = host.cpu_inference_slots - busy
        if needs.inference_workers > slots:
            return (
                f"needs {needs.inference_workers} CPU inference worker"
                f"{'s' if needs.inference_workers != 1 else ''}; {max(slots, 0)} of "
                f"{host.cpu_inference_slots} are free on {host.name} "
                "(DARTBOARD_CPU_INFERENCE_SLOTS)"
            )
        router, workers = port_block(needs.inference_workers, base=port_base, taken=taken)
        return Placement(
            host=host.name,
            address=host.address,
            device="cpu",
            inference_gpus=[None] * needs.inference_workers,
            router_port=router,
            worker_ports=workers,
        )
    if not host.gpus:
        return f"needs GPUs (device cuda); {host.name} has none"
    if not host.cuda_torch:
        return (
            f"{host.name} has {len(host.gpus)} GPUs but this .venv's torch is the CPU build: "
            "replace it with `make torch-cuda` (docs/gpu-and-vllm.md), or set the "
            "run's device to cpu"
        )
    free = _free_gib(host, taken)
    try:
        trainer_gib = needs.trainer_gib(max(gpu.memory_gib for gpu in host.gpus))
    except DoesNotFit as exc:
        return f"{host.name}: {exc}"
    # Trainer replicas first, on the GPUs with the most room; then the inference workers.
    order = sorted(free, key=lambda i: (-free[i], i))
    trainer = [i for i in order if free[i] >= trainer_gib][: needs.trainer_replicas]
    if len(trainer) < needs.trainer_replicas:
        roomy = sum(1 for i in free if free[i] >= trainer_gib)
        return (
            f"needs {needs.trainer_replicas} GPU{'s' if needs.trainer_replicas != 1 else ''} "
            f"with {trainer_gib:.0f} GiB free for the trainer; {roomy} "
            f"{'is' if roomy == 1 else 'are'} free on {host.name}"
        )
    left = dict(free)
    for i in trainer:
        left[i] -= trainer_gib
    shared = needs.backend == "vllm" and needs.vllm_gpus == "shared"
    pool = trainer if shared else [i for i in order if i not in trainer]
    inference: list[int | None] = []
    gpus = {gpu.index: gpu for gpu in host.gpus}
    roomy = sum(1 for i in pool if left[i] >= needs.inference_gib(gpus[i]))
    for i in pool:
        if len(inference) == needs.inference_workers:
            break
        if left[i] >= needs.inference_gib(gpus[i]):
            left[i] -= needs.inference_gib(gpus[i])
            inference.append(i)
    if len(inference) < needs.inference_workers:
        want = needs.inference_gib(host.gpus[0])
        return (
            f"needs {needs.trainer_replicas + needs.inference_workers} GPUs "
            f"({needs.trainer_replicas} for the trainer, {needs.inference_workers} with "
            f"{want:.0f} GiB free for inference); {roomy} more "
            f"{'is' if roomy == 1 else 'are'} free on {host.name}"
        )
    router, workers = port_block(needs.inference_workers, base=port_base, taken=taken)
    return Placement(
        host=host.name,
        address=host.address,
        device="cuda",
        trainer_gpus=trainer,
        inference_gpus=inference,
        router_port=router,
        worker_ports=workers,
        gpu_gib={str(i): round(free[i] - left[i], 2) for i in free if free[i] != left[i]},
    )


def checkpoint_gib(path: str) -> float:
    """A checkpoint directory's weights in bf16, in GiB: their size on disk (safetensors,
    bin), halved where the config says float32; 0 when it is not on this disk (an artifact
    reference, fetched later)."""
    root = Path(path)
    if not root.is_dir():
        return 0.0
    total = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    total = total or sum(f.stat().st_size for f in root.glob("*.bin"))
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    fp32 = (config.get("dtype") or config.get("torch_dtype")) == "float32"
    return total / GIB / (2 if fp32 else 1)
