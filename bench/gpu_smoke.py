"""The GPU path in one run (at most ~8 minutes on one GPU): what CI, which has no GPU, cannot
check. Prints one table: library versions; vLLM's start time; a LoRA update of the mid-size
Qwen2.5-VL-shaped model (bench/realsize.py's) on 5 screenshots at 1920x1080 with its peak
memory beside bench/realsize.py's plan; an adapter sync and a full-weight reload under load
from 8 clients (time, failed requests); the trainer-vs-vLLM log-prob gap in bf16; tokens per
second.

    .venv/bin/python bench/gpu_smoke.py            # on a GPU host, with .venv-vllm built
    .venv/bin/python bench/gpu_smoke.py --cpu      # the same steps on this CPU, tiny policy

vLLM starts exactly as the launcher starts it (`hostagent.launcher.vllm_specs`), from
`.venv-vllm` (or DARTBOARD_VLLM_PYTHON: on a GPU host, an environment with
requirements-gpu.txt). Everything runs under a temporary DARTBOARD_HOME.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCREEN = (1920, 1080)
SCREENS = 5


def _setup(home: Path) -> None:
    os.environ.update({"DARTBOARD_HOME": str(home), "DJANGO_SETTINGS_MODULE": "dartboard.settings"})
    os.environ.setdefault("DARTBOARD_SERVICE_TOKEN", os.urandom(24).hex())
    from rollout.auth import ServiceTokens

    os.environ.update(ServiceTokens.derived(os.environ["DARTBOARD_SERVICE_TOKEN"]).environ())
    import django

    django.setup()


def _screens(n: int, size: tuple[int, int]) -> list[bytes]:
    import io

    from PIL import Image, ImageDraw

    out = []
    for i in range(n):
        image = Image.new("RGB", size, (235, 235, 240))
        draw = ImageDraw.Draw(image)
        draw.rectangle((100 + 40 * i, 200, 400 + 40 * i, 300), fill=(40, 90, 200))
        draw.text((120 + 40 * i, 230), f"Submit {i}", fill=(255, 255, 255))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def _messages(screens: list[bytes]) -> list[dict]:
    from core.prompts import HistoryTurn, build_messages

    history = [HistoryTurn(thought=f"step {i}", action_text="click(start_box='(10,10)')")
               for i in range(len(screens) - 1)]  # fmt: skip
    return build_messages(instruction="Click the Submit button.", history=history,
                          screenshots=screens, max_images=len(screens))  # fmt: skip


def _model(workdir: Path, *, cpu: bool) -> Path:
    """The policy the smoke serves and trains: the tiny policy on CPU; on a GPU the mid-size
    Qwen2.5-VL shape, saved in bf16 (vLLM then serves bf16, the trainer keeps fp32 weights)."""
    import torch

    if cpu:
        return ROOT / "policies" / "tiny-grounded"
    from bench.realsize import build_mid
    from core.imaging import QWEN25_VL
    from core.policy import load_policy, save_checkpoint

    build_mid(workdir)
    policy = load_policy(workdir / "mid", dtype=torch.bfloat16)
    save_checkpoint(policy, workdir / "mid-bf16")
    # The released model's image bounds (the tiny policy's processor keeps 256 tokens per
    # image): a 1920x1080 screenshot becomes its ~2,600 tokens, as for UI-TARS.
    QWEN25_VL.processor().save_pretrained(workdir / "mid-bf16")
    return workdir / "mid-bf16"


class _Load:
    """8 clients asking in a loop; counts answers and failures."""

    def __init__(self, url: str, messages: list[dict]) -> None:
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(url, messages))
                         for _ in range(8)]  # fmt: skip

    def _loop(self, url: str, messages: list[dict]) -> None:
        from rollout.client import PolicyClient

        with PolicyClient(url, timeout=300) as client:
            while not self._stop.is_set():
                try:
                    client.complete(messages, max_tokens=8)
                    self.ok += 1
                except Exception as exc:  # the smoke's finding
                    self.failed.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(3)
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)


def _reload(url: str, admin: str, checkpoint: Path, version: int) -> tuple[float, int]:
    import httpx

    started = time.monotonic()
    r = httpx.post(f"{url}/v1/reload", json={"checkpoint": str(checkpoint), "version": version},
                   headers={"Authorization": f"Bearer {admin}"}, timeout=600)  # fmt: skip
    return time.monotonic() - started, r.status_code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run the steps on this CPU (tiny policy)")
    ap.add_argument("--trainer-only", action="store_true",
                    help="the trainer's checks alone: for a GPU host without vLLM or Django")  # fmt: skip
    ap.add_argument("--profile", action="store_true",
                    help="with --trainer-only: print the LoRA update's 15 costliest operators")  # fmt: skip
    args = ap.parse_args()
    import torch
    import transformers

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --cpu for the CPU walk-through")
    device = "cpu" if args.cpu else "cuda"
    card = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    rows = [("device", card), ("torch", torch.__version__),
            ("transformers", transformers.__version__)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dartboard-gpu-smoke-") as tmp:
        home = Path(tmp)
        if args.trainer_only:
            rows.append(("vLLM", "not run (--trainer-only)"))
            model = _model(home, cpu=args.cpu)
            screens = _screens(SCREENS, (640, 360) if args.cpu else SCREEN)
            _trainer_checks(rows, model=model, messages=_messages(screens), device=device,
                            runs=home / "runs", full_update=not args.profile,
                            profile=args.profile)  # fmt: skip
        else:
            _setup(home)
            _with_vllm(rows, home=home, device=device, cpu=args.cpu)
    print("| check | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def _peak(device: str) -> str:
    import torch

    if device != "cuda":
        return "(GPU memory: not on a CPU)"
    return f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated"


def _trainer_checks(rows: list[tuple[str, str]], *, model: Path, messages: list[dict],
                    device: str, runs: Path, full_update: bool,
                    profile: bool = False) -> tuple[Path, Path | None]:  # fmt: skip
    """A LoRA update on SCREENS full-size screenshots (time, peak memory), then a full
    fine-tuning update of the same steps (with full_update) and the trainer's own precision
    gap: its bf16-autocast log-probs against fp32 on the same tokens. Returns the adapter
    (version 1) and the full weights (version 2; None with full_update) a vLLM reload loads."""
    import torch

    from core.encoding import encode_batch, response_token_ids
    from core.generation import sequence_logprobs
    from core.samples import TrainSample
    from training.config import CurationConfig, TrainerConfig
    from training.trainer import PolicyTrainer

    sample = TrainSample(step_id=1, trajectory_id=1, group_id=0, messages=messages,
                         response_text="Action: click(start_box='(250,250)')", reward=1.0,
                         rollout_logprobs=[], mean_entropy=1.0, policy_version=0)  # fmt: skip
    failing = TrainSample(**{**sample.__dict__, "step_id": 2, "trajectory_id": 2, "reward": 0.0})
    curation = CurationConfig(high_entropy=False, truncated_is=False)
    update = TrainerConfig(kl_coef=0.1, micro_batch=1)
    trainers = [("LoRA r16", replace(update, lr=1e-4, lora_rank=16, lora_alpha=32))]
    if full_update:
        trainers += [("full fine-tuning", replace(update, lr=1e-5)),
                     ("full fine-tuning, gradient checkpointing",
                      replace(update, lr=1e-5, gradient_checkpointing="on"))]  # fmt: skip
    first = True
    for label, settings in trainers:
        trainer = PolicyTrainer(config=settings, start_checkpoint=model,
                                run_dir=runs / f"smoke-{label[:4]}", device=device)  # fmt: skip
        if first:
            started = time.monotonic()
            batch = encode_batch(trainer.policy, [messages],
                                 responses=[response_token_ids(trainer.policy, sample.response_text)])  # fmt: skip
            encode_s = time.monotonic() - started
            tokens = int(batch.attention_mask.sum())
            rows.append(("one step", f"{SCREENS} screenshots, {tokens} tokens; encoding them "
                                     f"(CPU, every update) {encode_s:.1f} s"))  # fmt: skip
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        busy_s = None
        try:
            # The optimizer's moments exist from the first update on: the second is timed, and
            # with profile a third, the same work, runs under the profiler.
            for _ in range(3 if profile else 2):
                started = time.monotonic()
                if profile and len(times) == 2:
                    busy_s = _profiled(partial(trainer.update, [sample, failing], curation),
                                       device=device)  # fmt: skip
                else:
                    trainer.update([sample, failing], curation)
                times.append(time.monotonic() - started)
        except torch.OutOfMemoryError:
            rows.append((f"{label} update", f"out of memory; {_peak(device)}"))
        else:
            rows.append((f"{label} update, 2 steps (second update)",
                         f"{times[1]:.1f} s ({2 * tokens / times[1]:.0f} tokens/s), "
                         f"{_peak(device)}"))  # fmt: skip
            if busy_s is not None and device == "cuda":
                rows.append((f"{label} update: GPU busy (kernel time / update time)",
                             f"{busy_s:.2f} s of {times[1]:.2f} s ({busy_s / times[1]:.0%}); "
                             f"under the profiler the update took {times[2]:.2f} s"))  # fmt: skip
        if first and device == "cuda":
            rows.append(("LoRA peak as bench/realsize.py plans it", _planned(batch)))
            rows.append(("trainer precision gap, bf16 autocast vs fp32",
                         _precision_gap(trainer, batch, sequence_logprobs)))  # fmt: skip
        if settings.lora_rank:
            adapter = trainer.save_version(1)
        first = False
        del trainer
        if device == "cuda":
            torch.cuda.empty_cache()
    if full_update:
        return adapter, None
    full = PolicyTrainer(config=TrainerConfig(lr=1e-5, kl_coef=0.0), start_checkpoint=model,
                         run_dir=runs / "smoke-full", device=device).save_version(2)  # fmt: skip
    return adapter, full


def _profiled(step, *, device: str) -> float:
    """Runs step under torch's profiler and prints the 15 operators with the most time on the
    device (on a CPU: on the CPU), so a slow update says where its time goes. Returns the
    seconds the device spent in kernels (on a CPU: the operators' own CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    from torch.autograd import DeviceType

    averages = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    print(averages.table(sort_by=key, row_limit=15, max_name_column_width=60))
    if device != "cuda":
        return sum(event.self_cpu_time_total for event in averages) / 1e6
    # The kernels' and copies' own rows: an operator's row repeats the time of what it launched.
    return sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / 1e6


def _planned(batch) -> str:
    """bench/realsize.py's plan for this LoRA step of the mid-size model: the base in bf16 (as
    load_policy loads it on a GPU), the adapters and their moments in fp32, activations
    measured in bf16 (what autocast keeps)."""
    import torch

    from bench.realsize import MID, MID_VISION, config_of, counts, measure_activations, plan

    c = counts(config_of(MID["text"], tie=MID["tie"], vision=MID_VISION))
    act = measure_activations(MID, dtype=torch.bfloat16, lora=True)
    p = plan(c, act, layers=MID["text"]["num_hidden_layers"], depth=MID_VISION["depth"],
             lora=True, frozen_bytes=2, checkpointing=False, shards=1,
             tokens=int(batch.attention_mask.sum()),
             patches=int(batch.image_grid_thw.prod(-1).sum()), vocab=MID["text"]["vocab_size"],
             response=int(batch.response_mask.sum(1).max()))  # fmt: skip
    return (f"{p.total / 2**30:.1f} GiB (weights {p.weights / 2**30:.1f}, activations "
            f"{p.activations / 2**30:.1f}); the autocast's bf16 weight copies are not planned")  # fmt: skip


def _precision_gap(trainer, batch, sequence_logprobs) -> str:
    """The trainer's log-probs of the same response tokens with and without bf16 autocast."""
    import torch

    batch = batch.to(trainer.device)
    with torch.no_grad():
        with trainer.autocast():
            mixed, _, mask = sequence_logprobs(trainer.policy.model, batch)
        full, _, _ = sequence_logprobs(trainer.policy.model, batch)
    gaps = (mixed.float() - full.float()).abs()[mask.bool()]
    return f"mean {gaps.mean():.4f}, max {gaps.max():.4f} nats/token"


def _with_vllm(rows: list[tuple[str, str]], *, home: Path, device: str, cpu: bool) -> None:
    """Long because it is the smoke's checks in order, sharing one vLLM and one home."""
    from django.conf import settings

    from hostagent.launcher import Supervisor, vllm_specs
    from rollout.auth import ServiceTokens
    from rollout.client import PolicyClient
    from rollout.vllm_command import vllm_missing, vllm_python

    if missing := vllm_missing():
        raise SystemExit(missing)
    import subprocess

    vllm_version = subprocess.run([str(vllm_python()), "-c", "import vllm; print(vllm.__version__)"],
                                  capture_output=True, text=True).stdout.strip()  # fmt: skip
    rows.append(("vLLM", vllm_version))
    model = _model(home, cpu=cpu)
    screens = _screens(SCREENS, (640, 360) if cpu else SCREEN)
    messages = _messages(screens)

    # 1. The trainer: a LoRA update on 5 full-size screenshots; the versions vLLM reloads.
    adapter, full = _trainer_checks(rows, model=model, messages=messages, device=device,
                                    runs=Path(settings.CHECKPOINT_ROOT), full_update=False)  # fmt: skip

    # 2. vLLM as the launcher starts it.
    tokens = ServiceTokens(settings.DARTBOARD_INFERENCE_TOKEN, settings.DARTBOARD_ADMIN_TOKEN)
    port = 18601
    gpu_memory = None if cpu else 0.5  # beside this process's trainer
    specs = vllm_specs(0, str(model), port, tokens=tokens, gpu=0, gpu_memory=gpu_memory)
    supervisor = Supervisor(home=home, specs=specs)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    supervisor.start()
    try:
        with PolicyClient(url, timeout=600) as client:
            while True:
                try:
                    client.complete(messages, max_tokens=4)
                    break
                except Exception:
                    if time.monotonic() - started > 600:
                        raise SystemExit(f"vLLM did not answer in 600 s: {home}/logs") from None
                    time.sleep(2)
        rows.append(("vLLM start to first answer", f"{time.monotonic() - started:.0f} s"))

        # 3. Adapter sync and full reload under load.
        for label, checkpoint, version in (
            ("adapter sync", adapter, 1),
            ("full reload", full, 2),
        ):
            with _Load(url, messages) as load:
                time.sleep(3)
                seconds, status = _reload(url, tokens.admin, checkpoint, version)
            failed = f"{len(load.failed)} failed of {load.ok + len(load.failed)}"
            rows.append((f"{label} under 8 clients", f"{seconds:.1f} s, HTTP {status}, {failed}"))
            if status != 200:
                rows.append((f"{label} FAILED", f"see {home}/logs/inference-0.log"))

        # 4. The log-prob gap: vLLM's greedy tokens scored by the trainer (bf16 autocast).
        from core.encoding import encode_batch
        from core.generation import sequence_logprobs
        from training.config import TrainerConfig
        from training.trainer import PolicyTrainer

        scorer = PolicyTrainer(config=TrainerConfig(lr=1e-5, kl_coef=0.0), start_checkpoint=full,
                               run_dir=home / "score", device=device)  # fmt: skip
        gaps = []
        with PolicyClient(url, timeout=300) as client:
            for i in range(4):
                prompt = _messages(screens[: i + 2])
                served = client.complete(prompt, max_tokens=24, temperature=0.0)
                batch = encode_batch(scorer.policy, [prompt], responses=[served.token_ids])
                values = _score(scorer, batch, sequence_logprobs)
                gaps += [abs(a - b) for a, b in zip(values, served.token_logprobs, strict=True)]
        rows.append(("log-prob gap, trainer vs vLLM",
                     f"mean {statistics.mean(gaps):.4f}, max {max(gaps):.4f} nats/token"))  # fmt: skip

        # 5. Throughput: 32 requests of 64 tokens at once.
        done: list[int] = []

        def one() -> None:
            with PolicyClient(url, timeout=600) as client:
                done.append(client.complete(messages, max_tokens=64).response_tokens)

        threads = [threading.Thread(target=one) for _ in range(32)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append(("generation, 32 concurrent requests",
                     f"{sum(done) / (time.monotonic() - started):.0f} tokens/s"))  # fmt: skip
    finally:
        supervisor.stop()


def _score(trainer, batch, sequence_logprobs) -> list[float]:
    """The trainer's log-probs of a batch's response tokens, in its forward's precision."""
    import torch

    with torch.no_grad(), trainer.autocast():
        values, _, mask = sequence_logprobs(trainer.policy.model, batch)
    return values[mask.bool()].tolist()


if __name__ == "__main__":
    main()
