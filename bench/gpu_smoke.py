"""The GPU path in one run (at most ~8 minutes on one GPU): what CI, which has no GPU, cannot
check. Prints one table: library versions; vLLM's start time; a LoRA update of the mid-size
Qwen2.5-VL-shaped model (bench/realsize.py's) on 5 screenshots at 1920x1080 with its peak
memory beside bench/realsize.py's plan; an adapter sync and a full-weight reload under load
from 8 clients (time, failed requests); the trainer-vs-vLLM log-prob gap in bf16; tokens per
second.

    .venv/bin/python bench/gpu_smoke.py            # on a GPU host, with .venv-vllm built
    .venv/bin/python bench/gpu_smoke.py --cpu      # the same steps on this CPU, tiny policy

vLLM starts exactly as the launcher starts it (`dartboard.launcher.vllm_specs`), from
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
    from core.policy import load_policy, save_checkpoint

    build_mid(workdir)
    policy = load_policy(workdir / "mid", dtype=torch.bfloat16)
    save_checkpoint(policy, workdir / "mid-bf16")
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
    """Long because it is the smoke's checks in order, sharing one vLLM and one home."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run the steps on this CPU (tiny policy)")
    args = ap.parse_args()
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="dartboard-gpu-smoke-") as tmp:
        home = Path(tmp)
        _setup(home)
        import torch
        import transformers
        from django.conf import settings

        from dartboard.launcher import Supervisor, vllm_specs
        from rollout.auth import ServiceTokens
        from rollout.client import PolicyClient
        from rollout.vllm_command import vllm_missing, vllm_python

        if missing := vllm_missing():
            raise SystemExit(missing)
        if not args.cpu and not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: run with --cpu for the CPU walk-through")
        device = "cpu" if args.cpu else "cuda"
        import subprocess

        vllm_version = subprocess.run([str(vllm_python()), "-c", "import vllm; print(vllm.__version__)"],
                                      capture_output=True, text=True).stdout.strip()  # fmt: skip
        card = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
        rows += [("device", card), ("torch", torch.__version__),
                 ("transformers", transformers.__version__), ("vLLM", vllm_version)]  # fmt: skip
        model = _model(home, cpu=args.cpu)
        screens = _screens(SCREENS, (640, 360) if args.cpu else SCREEN)
        messages = _messages(screens)

        # 1. A LoRA update on 5 full-size screenshots: peak memory against the plan.
        from core.lora import LoraSpec
        from core.samples import TrainSample
        from training.trainer import PolicyTrainer
        from training.update import UpdateConfig

        runs = Path(settings.CHECKPOINT_ROOT)  # where a reload may load from
        trainer = PolicyTrainer(start_checkpoint=model, run_dir=runs / "smoke-lora", lr=1e-4,
                                kl_coef=0.1, device=device, lora=LoraSpec(rank=16, alpha=32))  # fmt: skip
        sample = TrainSample(step_id=1, trajectory_id=1, group_id=0, messages=messages,
                             response_text="Action: click(start_box='(250,250)')", reward=1.0,
                             rollout_logprobs=[], mean_entropy=1.0, policy_version=0)  # fmt: skip
        failing = TrainSample(
            **{**sample.__dict__, "step_id": 2, "trajectory_id": 2, "reward": 0.0}
        )
        config = UpdateConfig(kl_coef=0.1, entropy_top_q=1.0, truncated_is=False, micro_batch=1)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started = time.monotonic()
        trainer.update([sample, failing], config)
        update_s = time.monotonic() - started
        peak = (
            f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated"
            if device == "cuda"
            else "(GPU memory: not on a CPU)"
        )
        rows.append((f"LoRA update, 2 steps of {SCREENS} screenshots", f"{update_s:.1f} s, {peak}"))
        adapter = trainer.save_version(1)
        del trainer
        full = PolicyTrainer(start_checkpoint=model, run_dir=runs / "smoke-full", lr=1e-5, kl_coef=0.0,
                             device=device).save_version(2)  # fmt: skip
        if device == "cuda":
            torch.cuda.empty_cache()

        # 2. vLLM as the launcher starts it.
        tokens = ServiceTokens(settings.DARTBOARD_INFERENCE_TOKEN, settings.DARTBOARD_ADMIN_TOKEN)
        port = 18601
        gpu_memory = None if args.cpu else 0.5  # beside this process's trainer
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
                rows.append(
                    (f"{label} under 8 clients", f"{seconds:.1f} s, HTTP {status}, {failed}")
                )
                if status != 200:
                    rows.append((f"{label} FAILED", f"see {home}/logs/inference-0.log"))

            # 4. The log-prob gap: vLLM's greedy tokens scored by the trainer (bf16 autocast).
            from core.encoding import encode_batch
            from core.generation import sequence_logprobs

            scorer = PolicyTrainer(start_checkpoint=full, run_dir=home / "score", lr=1e-5,
                                   kl_coef=0.0, device=device)  # fmt: skip
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
    print("| check | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def _score(trainer, batch, sequence_logprobs) -> list[float]:
    """The trainer's log-probs of a batch's response tokens, in its forward's precision."""
    import torch

    with torch.no_grad(), trainer.autocast():
        values, _, mask = sequence_logprobs(trainer.policy.model, batch)
    return values[mask.bool()].tolist()


if __name__ == "__main__":
    main()
