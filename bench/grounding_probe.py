"""The smallest grounding problem: can the tiny policy learn where one box is?

    .venv/bin/python bench/grounding_probe.py --minutes 12
    .venv/bin/python bench/grounding_probe.py --minutes 10 --rope-theta 50 --temporal-section 2
    .venv/bin/python bench/grounding_probe.py --minutes 10 --abs-pos

Each screen is a 160x210 white page under MiniWoB's yellow bar with one dark 30x20 box at a
random place; the prompt is a one-line system prompt, the instruction "Click the box" and
the screenshot; the target is only ``(x,y)``, the box centre in model-image pixels.
Behaviour cloning with AdamW, batch 16, one CPU thread; every 100 steps it prints the loss,
the share of greedy answers inside the box on 48 held-out screens, and their mean L1 error
in screen pixels (a random guess is ~100 px).

`--abs-pos` adds a learned absolute 2D position table to the image tokens (through a forward
hook on the vision tower; Qwen2.5-VL has no such table, Qwen3-VL's vision tower does): an
experiment on the architecture, not something a checkpoint can carry.
"""

from __future__ import annotations

import argparse
import io
import random
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from rollout.prompts import build_messages  # noqa: E402
from training.losses import bc_loss  # noqa: E402
from training.model import (  # noqa: E402
    Policy,
    encode_batch,
    generate,
    load_policy,
    response_token_ids,
    sequence_logprobs,
)
from training.tiny_policy import build_tiny_policy  # noqa: E402

Box = tuple[int, int, int, int]
MODEL_W, MODEL_H = 168, 224  # smart_resize(160x210, factor 28)


def screen(rng: random.Random) -> tuple[bytes, Box]:
    img = Image.new("RGB", (160, 210), "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 0, 159, 49], fill=(255, 255, 0))
    x, y = rng.randrange(0, 130), rng.randrange(55, 190)
    draw.rectangle([x, y, x + 29, y + 19], fill=(60, 60, 60))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue(), (x, y, x + 30, y + 20)


def messages(png: bytes) -> list[dict]:
    return build_messages(
        instruction="Click the box", history=[], screenshots=[png], system_prompt="GUI agent."
    )


def answer(box: Box) -> str:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return f"({round(cx * MODEL_W / 160)},{round(cy * MODEL_H / 210)})"


def add_absolute_positions(policy: Policy) -> torch.nn.Parameter:
    """Hook a learned [32, 32, hidden] table onto the image tokens (raster order)."""
    hidden = policy.model.config.text_config.hidden_size
    table = torch.nn.Parameter(torch.randn(32, 32, hidden) * 0.1)

    def hook(module, args, kwargs, output):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        adds = []
        for t, h, w in grid.tolist():
            rows, cols = h // 2, w // 2  # after the 2x2 merge
            adds.append(table[:rows, :cols].reshape(rows * cols, hidden).repeat(t, 1))
        output.pooler_output = output.pooler_output + torch.cat(adds)
        return output

    policy.model.model.visual.register_forward_hook(hook, with_kwargs=True)
    return table


@torch.no_grad()
def evaluate(policy: Policy, held: list[tuple[bytes, Box]]) -> tuple[float, float | None]:
    """(share of greedy clicks inside the box, mean L1 error in screen px of parsed ones)."""
    policy.model.eval()
    hits, errors = 0, []
    for i in range(0, len(held), 16):
        chunk = held[i : i + 16]
        outs = generate(policy, [messages(p) for p, _ in chunk], max_new_tokens=12, greedy=True)
        for (_, box), out in zip(chunk, outs, strict=True):
            found = re.search(r"\((\d+),(\d+)\)", out.text)
            if not found:
                continue
            x = int(found.group(1)) * 160 / MODEL_W
            y = int(found.group(2)) * 210 / MODEL_H
            hits += box[0] <= x < box[2] and box[1] <= y < box[3]
            errors.append(abs(x - (box[0] + box[2]) / 2) + abs(y - (box[1] + box[3]) / 2))
    policy.model.train()
    return hits / len(held), (sum(errors) / len(errors) if errors else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rope-theta", type=float, default=1_000_000.0)
    parser.add_argument("--temporal-section", type=int, default=0)
    parser.add_argument("--abs-pos", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_policy(
            Path(tmp) / "probe",
            rope_theta=args.rope_theta,
            temporal_section=args.temporal_section or None,
        )
        policy = load_policy(path)
    params = list(policy.model.parameters())
    if args.abs_pos:
        params.append(add_absolute_positions(policy))
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    rng, held_rng = random.Random(0), random.Random(99)
    held = [screen(held_rng) for _ in range(48)]
    started, step = time.perf_counter(), 0
    print("| step | seconds | loss | in box | L1 px |\n|---:|---:|---:|---:|---:|")
    while time.perf_counter() - started < args.minutes * 60:
        batch = [screen(rng) for _ in range(16)]
        responses = [response_token_ids(policy, answer(box)) for _, box in batch]
        enc = encode_batch(policy, [messages(p) for p, _ in batch], responses=responses)
        logprobs, _, mask = sequence_logprobs(policy, enc)
        loss = bc_loss(logprobs, mask)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        if step % 100 == 0:
            hit, l1 = evaluate(policy, held)
            l1_text = f"{l1:.0f}" if l1 is not None else "n/a"
            elapsed = time.perf_counter() - started
            print(f"| {step} | {elapsed:.0f} | {loss.item():.3f} | {hit:.0%} | {l1_text} |")
    hit, l1 = evaluate(policy, held)
    print(f"final after {step} steps: {hit:.1%} in the box, mean L1 {l1} px", flush=True)


if __name__ == "__main__":
    main()
