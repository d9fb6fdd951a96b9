"""Where one trainer update's time goes: per phase (encode, old-policy, reference, gradient,
optimizer, save, sync), attention calls and peak memory, before and after, in one run.

    .venv/bin/python bench/update_cost.py                          # tiny and narrow, CPU
    .venv/bin/python bench/update_cost.py --shapes narrow --samples 2 --repeats 2
    .venv/bin/python bench/update_cost.py --device cuda --shapes mid   # on a GPU host
    .venv/bin/python bench/update_cost.py --shapes narrow --modes padded,after \
        --samples 4 --screens 1,3 --micro-batch 8 --repeats 1     # packing, steps of 1 and 3

A step is SCREENS screenshots at 1920x1080 (the UI-TARS prompt's context; `--screens`: each
step's count in turn, as an episode's first steps show fewer) and a 30-token reply; an update
is `--samples` such steps of one task (half rewarded), LoRA r16 on the language model, KL to
the base (adapters off), micro-batches of `--micro-batch` steps (1 by default) and the
default token budget, repeated `--repeats` times on one trainer (the last is reported: the
first pays one-time costs).

Shapes:
- tiny: the shipped policy (policies/tiny-grounded, Qwen3-VL, 256 image tokens a screen);
- narrow: Qwen2.5-VL-7B's layout at widths 2 cores can run: 32 vision blocks (full attention
  in 7, 15, 23, 31, 112 px windows elsewhere), the merger, M-RoPE, 28 text layers, and the
  released processor bounds (10,764 patches, 2,691 tokens a 1920x1080 screen);
- mid: bench/realsize.py's mid-size Qwen2.5-VL (GPU only).

Modes:
- before: transformers' per-window vision attention, every pass encodes its prompts, pi_old in
  a separate pass (what the trainer did before `core.vision_attention` and `PromptCache`);
- padded: the trainer as it runs now, but a micro-batch's steps left-padded into rows
  instead of packed into one (`PolicyTrainer(pack=False)`);
- after: the trainer as it runs now.

Each (shape, mode) runs in a child process, so its peak memory is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCREENS, SCREEN = 5, (1920, 1080)
MODES = ("before", "padded", "after")
PHASES = (
    ("encode_s", "encode (inside the passes)"),
    ("old_pass_s", "old-policy pass"),
    ("ref_pass_s", "reference pass"),
    ("grad_pass_s", "gradient pass (forward + backward)"),
    ("optimizer_s", "optimizer"),
    ("duration_s", "update, in all"),
    ("save_s", "save the version"),
    ("sync_s", "sync it into a serving policy"),
)
NARROW = {"hidden": 64, "layers": 28, "heads": 4, "kv_heads": 2, "intermediate": 128,
          "vision_hidden": 64, "vision_depth": 32, "vision_heads": 2,
          "fullatt_blocks": (7, 15, 23, 31)}  # fmt: skip


def build(shape: str, workdir: Path) -> Path:
    """The checkpoint directory of `shape` (built under workdir, except the shipped tiny)."""
    if shape == "tiny":
        return ROOT / "policies" / "tiny-grounded"
    if shape == "mid":
        from bench.realsize import build_mid

        build_mid(workdir)
        out = workdir / "mid"
    else:
        from training.tiny_policy import build_tiny_policy

        out = build_tiny_policy(workdir / "narrow", arch="qwen2_5_vl", **NARROW)  # type: ignore[arg-type]
    released_processor(out)
    return out


def released_processor(checkpoint: Path) -> None:
    """Give a built checkpoint Qwen2.5-VL's released processor bounds (core.imaging's
    QWEN25_VL): a 1920x1080 screen is then 10,764 patches, not the tiny policy's 256 tokens."""
    from core.imaging import QWEN25_VL

    QWEN25_VL.processor().save_pretrained(checkpoint)


def _samples(policy, n: int, screens: list[int]) -> list:
    """`n` steps, step i showing screens[i % len(screens)] screenshots."""
    from bench.gpu_smoke import _messages, _screens
    from core.encoding import response_token_ids
    from core.samples import TrainSample

    shown = _screens(max(screens), SCREEN)
    reply = "Thought: the Submit button.\nAction: click(start_box='(250,250)')"
    ids = response_token_ids(policy, reply)
    return [
        TrainSample(step_id=i + 1, trajectory_id=i + 1, group_id=0,
                    messages=_messages(shown[: screens[i % len(screens)]]),
                    response_text=reply, reward=float(i % 2 == 0),
                    rollout_logprobs=[-1.0] * len(ids), mean_entropy=1.0, policy_version=0,
                    response_token_ids=ids)
        for i in range(n)
    ]  # fmt: skip


def _attention_calls(update) -> tuple[object, int]:
    """Run `update()` counting scaled_dot_product_attention calls (one per kernel launch)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        result = update()
    return result, Count.calls


def child(
    checkpoint: Path, mode: str, *, samples: int, repeats: int, device: str, screens: list[int],
    micro_batch: int,
) -> dict:  # fmt: skip
    """One (shape, mode): `repeats` updates on one trainer; the last one's phases."""
    import torch

    from core.policy import load_policy, load_weights_into
    from core.vision_attention import use_reference_vision_attention
    from training.config import CurationConfig, TrainerConfig
    from training.trainer import PolicyTrainer

    torch.manual_seed(0)
    before = mode == "before"
    with tempfile.TemporaryDirectory() as runs:
        settings = TrainerConfig(lr=1e-4, kl_coef=0.1, micro_batch=micro_batch, lora_rank=16,
                                 lora_alpha=32)  # fmt: skip
        trainer = PolicyTrainer(config=settings, start_checkpoint=checkpoint, run_dir=Path(runs),
                                device=device, pack=mode == "after",
                                prompt_cache_bytes=0 if before else 2 * 1024**3)  # fmt: skip
        if before:
            use_reference_vision_attention(trainer.policy.model.get_base_model())
        batch = _samples(trainer.policy, samples, screens)
        curation = CurationConfig(high_entropy=False)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def update():
            return trainer.update(batch, curation, separate_old_pass=before)

        _, calls = _attention_calls(update)  # the first update: counted, not timed
        for _ in range(repeats - 1):
            metrics = update()
        if repeats == 1:
            metrics = update()
        out = {k: getattr(metrics, k) for k, _ in PHASES if hasattr(metrics, k)}
        out["passes"] = metrics.passes
        out["attention_calls"] = calls
        if device == "cuda":
            out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        else:  # the updates' peak, before the serving copy below is loaded
            out["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        started = time.perf_counter()
        saved = trainer.save_version(1)
        out["save_s"] = time.perf_counter() - started
        serving = load_policy(checkpoint, device=device)
        started = time.perf_counter()
        load_weights_into(serving, saved)
        out["sync_s"] = time.perf_counter() - started
        text = trainer.policy.model.get_base_model().config.text_config
        vision = trainer.policy.model.get_base_model().config.vision_config
        out["blocks_layers"] = [vision.depth, text.num_hidden_layers]
        out["tokens"] = [len(_prompt(trainer.policy, s).ids) for s in batch]
        return out


def _prompt(policy, sample):
    from core.encoding import prompt_parts

    return prompt_parts(policy, sample.messages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="tiny,narrow", help="tiny, narrow, mid (comma list)")
    ap.add_argument("--samples", type=int, default=2, help="steps in an update")
    ap.add_argument("--repeats", type=int, default=2, help="updates on one trainer")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="before,after", help=f"of {', '.join(MODES)}")
    ap.add_argument("--screens", default=str(SCREENS),
                    help="screenshots of each step in turn (comma list)")  # fmt: skip
    ap.add_argument("--micro-batch", type=int, default=1, help="steps a micro-batch holds")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.samples < 2:
        ap.error("--samples must be at least 2: a task group of one trajectory has no advantage")
    screens = [int(n) for n in args.screens.split(",")]
    modes = args.modes.split(",")
    if any(m not in MODES for m in modes) or not 1 <= max(screens) <= SCREENS:
        ap.error(f"--modes must be of {', '.join(MODES)}; --screens from 1 to {SCREENS}")
    if args.child:
        checkpoint, mode = args.child
        result = child(Path(checkpoint), mode, samples=args.samples, repeats=args.repeats,
                       device=args.device, screens=screens,
                       micro_batch=args.micro_batch)  # fmt: skip
        print("RESULT " + json.dumps(result))
        return
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            checkpoint = build(shape, Path(tmp))
            results[shape] = {}
            for mode in modes:
                command = [sys.executable, __file__, "--child", str(checkpoint), mode,
                           "--samples", str(args.samples), "--repeats", str(args.repeats),
                           "--device", args.device, "--screens", args.screens,
                           "--micro-batch", str(args.micro_batch)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
                line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
                if done.returncode or not line:
                    sys.exit(f"{shape} {mode} failed:\n{done.stderr[-3000:]}")
                results[shape][mode] = json.loads(line[-1][len("RESULT ") :])
                print(f"{shape} {mode}: {results[shape][mode]['duration_s']:.1f} s", flush=True)
    print_table(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def print_table(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    print(f"\nOne update of {args.samples} steps ({args.screens} screenshots at "
          f"{SCREEN[0]}x{SCREEN[1]} each), LoRA r16, micro-batch {args.micro_batch}, device "
          f"{args.device}; update {args.repeats} of {args.repeats} on one trainer\n")  # fmt: skip
    for shape, runs in results.items():
        modes = list(runs)
        first, last = runs[modes[0]], runs[modes[-1]]
        blocks, layers = last["blocks_layers"]
        print(f"### {shape}: {blocks} vision blocks, {layers} text layers, "
              f"{', '.join(f'{n:,}' for n in last['tokens'])} prompt tokens a step\n")  # fmt: skip
        print(f"| phase | {' | '.join(modes)} | {modes[0]} / {modes[-1]} |")
        print("|---|" + "---:|" * (len(modes) + 1))
        for key, label in PHASES:
            ratio = f"{first[key] / last[key]:.2f}x" if last[key] > 0 else "skipped"
            cells = " | ".join(f"{runs[m][key]:.2f} s" for m in modes)
            print(f"| {label} | {cells} | {ratio} |")
        passes = " | ".join(runs[m]["passes"] for m in modes)
        print(f"| passes over each micro-batch | {passes} | |")
        calls = " | ".join(f"{runs[m]['attention_calls']:,}" for m in modes)
        print(f"| attention calls in the update | {calls} | "
              f"{first['attention_calls'] / last['attention_calls']:.0f}x |")  # fmt: skip
        unit = "GPU memory, GiB" if args.device == "cuda" else "process RSS, GiB"
        peaks = " | ".join(f"{runs[m]['peak_gib']:.2f}" for m in modes)
        print(f"| peak {unit} | {peaks} | |\n")


if __name__ == "__main__":
    main()
