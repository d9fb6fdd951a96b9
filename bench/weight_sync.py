"""Sync time and bytes per version, from a sender that holds the weights to N inference
workers, over the wire (`training.weight_server` -> `rollout.weight_receive`) against the
file path a version took before (write the checkpoint, upload it to the artifact store,
each worker fetches and verifies it, then reloads), for full weights and LoRA adapters, in
one run.

    .venv/bin/python bench/weight_sync.py                       # tiny and 0.9b, 2 workers
    .venv/bin/python bench/weight_sync.py --shapes tiny --repeats 2

Shapes:
- tiny: the shipped policy (policies/tiny-grounded), float32, as a CPU trainer serves it;
- 0.9b: a Qwen2.5-VL built from its config (no download, random weights): Qwen2.5-0.5B's text
  layout (896 wide, 24 layers, tied embeddings) under Qwen2.5-VL's vision blocks at depth 20,
  0.9B parameters, in bf16 (what a GPU trainer publishes). The sender holds only the weights
  (a full 0.9B trainer and two workers do not fit 24 GiB), as the trainer's weight server
  holds its snapshot.

The workers are processes of their own, each holding the model in the served dtype (a real
`core.policy.Policy`'s model, loaded from a saved v0). Over the wire a sync is: publish (the
sender copies and tags the weights) and every worker's pull, tag check and swap
(`WeightReceiver.load` + `install_weights`), the workers pulling at once. By file it is:
`save_pretrained` (weights only: a trainer under full fine-tuning also writes its optimizer
state, twice the weights' bytes, which is left out here), `core.artifacts.upload_dir` (its
sha256 manifest) into a file store on the same filesystem (hard links: the cheapest store
there is), then every worker at once `core.artifacts.fetch` into its own cache (sha256 of
every file) and `stage_weights` + `install_weights`. For full weights the table adds, beside,
what full fine-tuning adds to every version's file path (writing AdamW's moments, 8 bytes a
parameter, and hashing them for the manifest), measured once. Each row is the median of `--repeats`
syncs after one unmeasured warm-up (the last column: the fastest of them, the least
disturbed by other work on a shared machine); after each sync the bench checks that every
worker holds the sender's weights, bit for bit.

LoRA: r16 on the language model's attention and MLP projections (`core.lora`), the
adapters alone travel; the worker's base stays.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHIPPED = ROOT / "policies" / "tiny-grounded"
RANK = 16
VISION_09B = {"depth": 20, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16}
TEXT_09B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936}  # fmt: skip


def build(shape: str) -> torch.nn.Module:
    """The sender's model of `shape` (module doc), its weights real."""
    if shape == "tiny":
        from core.policy import load_policy

        return load_policy(SHIPPED).model
    from transformers import Qwen2_5_VLForConditionalGeneration

    from bench.realsize import config_of

    config = config_of(TEXT_09B, tie=True, vision=VISION_09B)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy on the way
    try:
        with torch.device("meta"):
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied lm_head storage of its own
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02, generator=generator)
    return model


def with_adapters(model: torch.nn.Module, base: Path) -> torch.nn.Module:
    from core.lora import LoraSpec, add_adapters

    model.name_or_path = model.config._name_or_path = str(base)  # what PEFT writes as base
    peft = add_adapters(model, LoraSpec(rank=RANK, alpha=2 * RANK), base=base)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.01)  # lora_B starts at zero: make the adapter change outputs
    return peft


def perturb(tensors: dict[str, torch.Tensor], step: int) -> None:
    """A new version: every tensor moves (what an update does to full weights or adapters)."""
    with torch.no_grad():
        for t in tensors.values():
            t.add_(1e-3 * (step + 1))


def fingerprint(model: torch.nn.Module, names: list[str]) -> list[str]:
    """sha256 of the named tensors' bytes: equal exactly when the weights are."""
    params = dict(model.named_parameters())
    raw = [params[n].detach().contiguous().view(torch.uint8).numpy() for n in names]
    return [hashlib.sha256(r).hexdigest() for r in raw]


# ----------------------------------------------------------------------- the workers


def worker_main(conn, v0: str) -> None:
    """One inference worker: a Policy loaded from `v0`, answering the bench's commands."""
    torch.set_num_threads(1)
    from transformers import AutoModelForImageTextToText

    from core.artifacts import ArtifactRef, FileStore, fetch
    from core.lora import LoraSpec, add_adapters
    from core.policy import Policy, install_weights, stage_weights
    from core.weight_wire import WeightSource
    from rollout.weight_receive import WeightReceiver

    dtype = torch.float32 if "tiny" in v0 else torch.bfloat16
    model = AutoModelForImageTextToText.from_pretrained(v0, dtype=dtype)
    policy = Policy(model, None, None, "", Path(v0))  # type: ignore[arg-type]
    receiver = WeightReceiver(timeout_s=300)
    conn.send("ready")
    while True:
        command, args = conn.recv()
        started = time.perf_counter()
        if command == "stop":
            return
        if command == "adapters":
            spec = LoraSpec(rank=RANK, alpha=2 * RANK)
            policy.model = add_adapters(policy.model, spec, base=Path(v0))
            policy.path = policy.base = Path(v0)  # the base the adapters were made on
            conn.send(0.0)
        elif command == "pull":
            body, version = args
            source = WeightSource.from_json(body, version=version)
            receiver.load(policy=policy, weights=source, swap=lambda s: install_weights(policy, s))
            conn.send(time.perf_counter() - started)
        elif command == "file":
            root, ref, cache = args
            local = fetch(FileStore(Path(root)), ArtifactRef.parse(ref), Path(cache))
            fetched = time.perf_counter()
            install_weights(policy, stage_weights(policy, local))
            conn.send((fetched - started, time.perf_counter() - fetched))
        elif command == "fingerprint":
            conn.send(fingerprint(policy.model, args))


class Workers:
    def __init__(self, n: int, v0: Path) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, str(v0)), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.recv() == "ready"

    def each(self, command: str, args_of) -> list:
        """Send `command` to every worker at once; their answers in order."""
        for i, conn in enumerate(self.conns):
            conn.send((command, args_of(i)))
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("stop", None))
        for proc in self.procs:
            proc.join(timeout=60)


# ----------------------------------------------------------------------- one shape


def measure(shape: str, *, workers: int, repeats: int, work: Path) -> list[dict]:
    from core.artifacts import FileStore
    from training.weight_server import WeightServer

    model = build(shape)
    dtype = next(model.parameters()).dtype
    v0 = work / f"{shape}-v0"
    model.save_pretrained(v0)
    if shape == "tiny":  # the processor files travel with a version: the trainer writes them
        for f in SHIPPED.iterdir():
            if f.is_file() and not f.name.startswith(("model", "config")):
                shutil.copy(f, v0 / f.name)
    store = FileStore(work / "store")
    pool = Workers(workers, v0)
    server = WeightServer(host="127.0.0.1", timeout_s=300)
    rows = []
    try:
        for kind in ("full", "adapter"):
            if kind == "adapter":
                model = with_adapters(model, v0)
                pool.each("adapters", lambda i: None)
            tensors = {
                n: p.detach() for n, p in model.named_parameters() if kind == "full" or "lora_" in n
            }
            names = list(tensors)  # every tensor is checked after every sync
            ask = lambda i, names=names: names  # noqa: E731
            wire, files = [], []
            for step in range(repeats + 1):  # the first is a warm-up
                perturb(tensors, step)
                version = 2 * step + (1 if kind == "full" else 100)
                wire.append(sync_by_wire(server, pool, tensors, version=version, kind=kind))
                held = pool.each("fingerprint", ask)
                assert held == [fingerprint(model, names)] * workers, (
                    held,
                    fingerprint(model, names),
                )
                perturb(tensors, step)
                files.append(sync_by_file(model, pool, store, work, version=version + 1, kind=kind))
                assert pool.each("fingerprint", ask) == [fingerprint(model, names)] * workers
            params = sum(p.numel() for p in model.parameters())
            state_s = optimizer_state_cost(params, work) if kind == "full" else None
            rows.append(summary(shape, kind, dtype, params, wire[1:], files[1:], workers, state_s))
            print_rows(rows[-1:], header=False)
    finally:
        server.close()
        pool.close()
        shutil.rmtree(work / "store", ignore_errors=True)
    return rows


def sync_by_wire(server, pool: Workers, tensors, *, version: int, kind: str) -> dict:
    started = time.perf_counter()
    source = server.publish(version=version, kind=kind, tensors=tensors)
    published = time.perf_counter()
    pulls = pool.each("pull", lambda i: (source.to_json(), version))
    done = time.perf_counter()
    return {
        "total": done - started,
        "publish": published - started,
        "pull": max(pulls),
        "bytes": server._current.header.total_bytes,  # what each worker received
    }


def sync_by_file(model, pool: Workers, store, work: Path, *, version: int, kind: str) -> dict:
    from core.artifacts import upload_dir

    directory = work / f"v{version}"
    shutil.rmtree(directory, ignore_errors=True)
    started = time.perf_counter()
    model.save_pretrained(directory)  # a PEFT model writes its adapter alone
    written = time.perf_counter()
    ref = upload_dir(store, f"bench/v{version}", directory)
    uploaded = time.perf_counter()
    answers = pool.each("file", lambda i: (str(store.root), str(ref), str(work / f"cache-{i}")))
    done = time.perf_counter()
    size = sum(f.stat().st_size for f in directory.iterdir())
    shutil.rmtree(directory, ignore_errors=True)
    for i in range(len(answers)):
        shutil.rmtree(work / f"cache-{i}", ignore_errors=True)
    return {
        "total": done - started,
        "write": written - started,
        "upload": uploaded - written,
        "fetch": max(a[0] for a in answers),
        "reload": max(a[1] for a in answers),
        "bytes": size,
    }


def optimizer_state_cost(params: int, work: Path) -> float:
    """What full fine-tuning adds to the file path, once: writing AdamW's two float32
    moments (8 bytes a parameter, `trainer_state.pt`) and hashing them for the manifest.
    Inference hosts skip that file when they fetch."""
    from core.artifacts import sha256_file

    path, chunk = work / "trainer_state.pt", torch.zeros(256 << 20, dtype=torch.uint8).numpy()
    started = time.perf_counter()
    with path.open("wb") as f:
        left = 8 * params
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
    sha256_file(path)
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def summary(shape, kind, dtype, params, wire, files, workers, state_s) -> dict:
    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    return {
        "shape": shape,
        "kind": "full weights" if kind == "full" else f"LoRA r{RANK}",
        "dtype": str(dtype).removeprefix("torch."),
        "params": params,
        "workers": workers,
        "wire_mb": wire[0]["bytes"] / 1e6,
        "file_mb": files[0]["bytes"] / 1e6,
        "wire_s": med(wire, "total"),
        "wire_best_s": min(r["total"] for r in wire),
        "file_best_s": min(r["total"] for r in files),
        "publish_s": med(wire, "publish"),
        "pull_s": med(wire, "pull"),
        "file_s": med(files, "total"),
        "write_s": med(files, "write"),
        "upload_s": med(files, "upload"),
        "fetch_s": med(files, "fetch"),
        "reload_s": med(files, "reload"),
        "state_s": state_s,
    }


def print_rows(rows: list[dict], *, header: bool) -> None:
    if header:
        print(
            "| shape | what | dtype | params | workers | bytes/worker, wire (MB) | "
            "file (MB) | wire sync (s) | publish | pull + swap | file sync (s) | write | "
            "upload | fetch + verify | reload | file / wire | best of each: wire, file (s) | "
            "+ optimizer state (s) | file with it / wire |"
        )
        print(
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        )
    for r in rows:
        print(
            f"| {r['shape']} | {r['kind']} | {r['dtype']} | {r['params'] / 1e6:.1f}M | "
            f"{r['workers']} | {r['wire_mb']:.2f} | {r['file_mb']:.2f} | {r['wire_s']:.3f} | "
            f"{r['publish_s']:.3f} | {r['pull_s']:.3f} | {r['file_s']:.3f} | "
            f"{r['write_s']:.3f} | {r['upload_s']:.3f} | {r['fetch_s']:.3f} | "
            f"{r['reload_s']:.3f} | {r['file_s'] / r['wire_s']:.1f}x | "
            f"{r['wire_best_s']:.3f}, {r['file_best_s']:.3f} | "
            + (
                f"{r['state_s']:.3f} | {(r['file_s'] + r['state_s']) / r['wire_s']:.1f}x |"
                if r["state_s"] is not None
                else "- | - |"
            ),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,0.9b")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs (load average {load} at the start); torch {torch.__version__}; "
          f"{args.workers} workers; median of {args.repeats} syncs after a warm-up")  # fmt: skip
    print_rows([], header=True)
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        for shape in args.shapes.split(","):
            measure(shape, workers=args.workers, repeats=args.repeats, work=Path(tmp))


if __name__ == "__main__":
    main()
