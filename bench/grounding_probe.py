"""The smallest grounding problem: can the tiny policy learn where one box is?

    .venv/bin/python bench/grounding_probe.py                     # Qwen3-VL + attention supervision
    .venv/bin/python bench/grounding_probe.py --attention-supervision 0
    .venv/bin/python bench/grounding_probe.py --arch qwen2_5_vl
    .venv/bin/python bench/grounding_probe.py --arch qwen2_5_vl --attention-supervision 0

Each screen is a 160x210 white page under MiniWoB's yellow bar with one dark 30x20 box at a
random place; the instruction is "Click the box"; the target is the box centre. It is the
shipped pretraining loop (`training.pretrain.bc_batch_loss_cached`: the rollout's prompt,
behaviour cloning on `click(start_box='(x,y)')`, optionally the attention-supervision term)
on that one kind of screen, `--steps` steps of batch 16, AdamW at a constant learning rate.
Every `--every` steps it prints the loss, the share of greedy clicks inside the box on 48
held-out screens and their mean L1 error in screen pixels (a random guess is ~100 px).

What it showed (docs/benchmarks.md, "Tiny policy grounding"): Qwen2.5-VL's rotary-only vision tower
does not ground here with or without attention supervision (the head finds the box but the
box's features do not say where it is); Qwen3-VL's absolute position table alone does not
either within minutes; both together do.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from core.generation import generate  # noqa: E402
from core.imaging import ImageGeometry  # noqa: E402
from core.policy import load_policy  # noqa: E402
from core.samples import GroundingSample  # noqa: E402
from training.pretrain_io import (  # noqa: E402
    bc_batch_loss_cached,
    predicted_click,
    sample_messages,
)
from training.synthetic import box_sample  # noqa: E402
from training.tiny_policy import build_tiny_policy  # noqa: E402


def screen(rng: random.Random) -> GroundingSample:
    x, y = rng.randrange(0, 130), rng.randrange(55, 190)
    return box_sample((x, y, x + 30, y + 20))


@torch.no_grad()
def evaluate(policy, held: list[GroundingSample], geometry: ImageGeometry) -> tuple[float, str]:
    """(share of greedy clicks inside the box, mean L1 error in screen px of parsed ones)."""
    policy.model.eval()
    hits, errors = 0, []
    outs = generate(policy, [sample_messages(s) for s in held], max_new_tokens=40, greedy=True)
    for s, out in zip(held, outs, strict=True):
        point = predicted_click(out.text, sample=s, coords="pixel", geometry=geometry)
        if point is not None:
            hits += s.box[0] <= point[0] < s.box[2] and s.box[1] <= point[1] < s.box[3]
            errors.append(abs(point[0] - s.x) + abs(point[1] - s.y))
    l1 = f"{sum(errors) / len(errors):.0f}" if errors else "n/a"
    return hits / len(held), l1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--arch", default="qwen3_vl", choices=["qwen3_vl", "qwen2_5_vl"])
    parser.add_argument("--attention-supervision", type=float, default=1.0)
    parser.add_argument("--attention-heads", type=int, default=1)
    parser.add_argument("--system-prompt", default="", help="instead of the rollout's default")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    if args.system_prompt:
        import training.pretrain as pretrain_module
        from core.prompts import build_messages

        def short_prompt(sample: GroundingSample) -> list[dict]:
            return build_messages(
                instruction=sample.instruction,
                history=[],
                screenshots=[sample.png],
                system_prompt=args.system_prompt,
            )

        pretrain_module.sample_messages = short_prompt  # the loss and evaluate() build with it
        globals()["sample_messages"] = short_prompt
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        policy = load_policy(build_tiny_policy(Path(tmp) / "probe", arch=args.arch))
    if args.attention_supervision > 0:
        policy.model.set_attn_implementation("eager")
    geometry = policy.image_geometry
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=args.lr)
    rng, held_rng = random.Random(0), random.Random(99)
    held = [screen(held_rng) for _ in range(48)]
    print(f"arch {args.arch}, attention supervision {args.attention_supervision}")
    print("| step | seconds | loss bc / attention | in box | L1 px |\n|---:|---:|---:|---:|---:|")
    started, step = time.perf_counter(), 0
    parts: dict[str, float] = {}
    while step < args.steps:
        policy.model.train()
        loss = bc_batch_loss_cached(
            policy,
            [screen(rng) for _ in range(16)],
            coords="pixel",
            geometry=geometry,
            attention_weight=args.attention_supervision,
            attention_heads=args.attention_heads,
            parts=parts,
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % args.every == 0:
            hit, l1 = evaluate(policy, held, geometry)
            elapsed = time.perf_counter() - started
            terms = f"{parts['bc']:.3f} / {parts.get('attention', 0):.3f}"
            print(f"| {step} | {elapsed:.0f} | {terms} | {hit:.0%} | {l1} |", flush=True)
    hit, l1 = evaluate(policy, held, geometry)
    print(f"final after {step} steps: {hit:.1%} in the box, mean L1 {l1} px", flush=True)


if __name__ == "__main__":
    main()
