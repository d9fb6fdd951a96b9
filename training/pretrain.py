"""Grounding pretraining of the tiny CPU policy: behaviour cloning on "click X" screens.

Data: synthetic PIL screens (`training.synthetic`, unlimited, a fresh one per sample) mixed
with first-step oracle clicks from real MiniWoB++ episodes of the 7 easy tasks (collected
once by `envmanager.grounding_screens`, seeds >= TRAIN_SEED_BASE so the bench's seeds stay held
out). Each sample becomes exactly the prompt the rollout builds (`core.prompts.
build_messages`, no history, one screenshot) and the response ``Action: click(start_box=
'<|box_start|>(x,y)<|box_end|>')`` with the target's centre in model-image coordinates;
the loss is `core.losses.bc_loss` on the response tokens.

The one command (writes the checkpoint and MANIFEST.json):

    .venv/bin/python manage.py pretrain_policy --out policies/tiny-grounded

Experiments without Django:

    .venv/bin/python -m envmanager.grounding_screens var/pretrain/miniwob.pkl 500
    .venv/bin/python -m training.pretrain train --out var/pretrain/exp1 --minutes 10 --lr 1e-3
"""

from __future__ import annotations

import json
import math
import pickle
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from core.actions import CoordSpace
from core.policy import Policy, load_policy, save_checkpoint
from core.samples import GroundingSample
from training.pretrain_io import Sample, bc_batch_loss_cached, grounding_accuracy
from training.synthetic import make_sample
from training.synthetic_desktop import SCENES, make_step
from training.tiny_policy import build_tiny_policy

# ------------------------------------------------------------------ the BC loop


@dataclass(frozen=True)
class PretrainConfig:
    """One pretraining run. `minutes` bounds the wall time; `max_steps` (if set) the steps."""

    seed: int = 0
    minutes: float = 20.0
    max_steps: int | None = None
    batch_size: int = 16
    lr: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    coords: str = "pixel"
    miniwob_fraction: float = 0.5  # share of each batch drawn from the MiniWoB demos
    desktop_fraction: float = 0.0  # share drawn from synthetic desktop steps (800x600)
    desktop_scenes: str = ""  # "pad:3,drag:2,...": weights of the desktop scenes; "": equal
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 1024
    vision_hidden: int = 128
    vision_depth: int = 2
    vision_heads: int = 4
    rope_theta: float = 1_000_000.0
    temporal_section: int = 0  # 0: the architecture's own split of the rotary frequencies
    arch: str = "qwen3_vl"
    init: str = ""  # continue from this checkpoint instead of fresh weights (arch ignored)
    attention_supervision: float = 1.0  # weight of the look-at-the-target loss; 0 disables
    eval_every: int = 200
    eval_samples: int = 64
    threads: int = 2


@dataclass
class PretrainResult:
    out_dir: Path
    steps: int
    samples: int
    seconds: float
    final_loss: float
    history: list[dict] = field(default_factory=list)  # loss and eval figures over time
    final_eval: dict[str, float] = field(default_factory=dict)


def scene_weights(spec: str) -> dict[str, float]:
    """`"pad:3,drag:2"` -> each desktop scene's weight (a scene not named: 0; `""`: all 1).

    Raises ValueError naming the part that is wrong: an unknown scene, a weight that is not
    a number >= 0, or weights that are all 0."""
    if not spec.strip():
        return {name: 1.0 for name in sorted(SCENES)}
    weights: dict[str, float] = {}
    for part in spec.split(","):
        name, _, value = part.strip().partition(":")
        if name not in SCENES:
            raise ValueError(
                f"desktop scene {name!r} in {spec!r} is unknown; expected one of {sorted(SCENES)}"
            )
        try:
            weight = float(value) if value else 1.0
        except ValueError:
            weight = -1.0
        if not weight >= 0:  # also NaN
            raise ValueError(
                f"desktop scene weight {part.strip()!r} in {spec!r}: need a number >= 0"
            )
        weights[name] = weight
    if not sum(weights.values()) > 0:
        raise ValueError(f"desktop scene weights {spec!r} are all 0")
    return weights


def _lr_at(config: PretrainConfig, step: int, progress: float) -> float:
    """Linear warmup over steps, then cosine decay to 10% over the run's progress (0..1)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _fresh_policy(config: PretrainConfig) -> Policy:
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_policy(
            tmp,
            seed=config.seed,
            hidden=config.hidden,
            layers=config.layers,
            heads=config.heads,
            kv_heads=config.kv_heads,
            intermediate=config.intermediate,
            vision_hidden=config.vision_hidden,
            vision_depth=config.vision_depth,
            vision_heads=config.vision_heads,
            rope_theta=config.rope_theta,
            temporal_section=config.temporal_section or None,
            arch=config.arch,
        )
        policy = load_policy(tmp)
    return policy


def pretrain(
    *,
    config: PretrainConfig,
    out_dir: str | Path,
    miniwob: list[GroundingSample] = (),  # type: ignore[assignment]
    log: Callable[[str], None] = print,
) -> PretrainResult:
    """Build a fresh tiny policy, behaviour-clone it on grounding samples, save it to
    `out_dir` (a checkpoint `load_policy` reads); return losses and held-out accuracy.

    Held out: 10% of `miniwob` (at most `eval_samples`), and `eval_samples` synthetic screens
    and (with `desktop_fraction`) desktop steps drawn from a seed no training batch uses.

    Long because it is the pretraining's stages in order: build, data, loop, save,
    manifest.
    """
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    coords: CoordSpace = config.coords  # type: ignore[assignment]
    miniwob = list(miniwob)
    random.Random(config.seed + 1).shuffle(miniwob)
    n_held = min(config.eval_samples, len(miniwob) // 10)
    held_miniwob, train_miniwob = miniwob[:n_held], miniwob[n_held:]
    eval_rng = random.Random(10_000_019 + config.seed)
    held: list[Sample] = [*held_miniwob]
    if config.desktop_fraction < 1:
        held += [make_sample(eval_rng) for _ in range(config.eval_samples)]
    if config.desktop_fraction > 0:
        held += [make_step(eval_rng) for _ in range(config.eval_samples)]

    # Without weights, make_step's own uniform draw (scene None): such runs draw as they always did.
    weights = scene_weights(config.desktop_scenes) if config.desktop_scenes.strip() else {}

    def draw_scene(rng: random.Random) -> str | None:
        return rng.choices(list(weights), weights=list(weights.values()))[0] if weights else None

    if config.init:
        policy = load_policy(config.init)
    else:
        policy = _fresh_policy(config)
    if config.attention_supervision > 0:
        # The loss reads the language model's attention weights: eager there, while the
        # vision tower keeps its packed attention from load_policy (`core.vision_attention`;
        # eager over an 800x600 screen's 1,008 patches doubled a step's time).
        policy.model.set_attn_implementation({"text_config": "eager"})
    geometry = policy.image_geometry  # the processor the policy ships with: one source
    optimizer = torch.optim.AdamW(
        policy.model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    budget = config.minutes * 60.0
    started = time.perf_counter()
    history: list[dict] = []
    step = 0
    running = None
    while True:
        elapsed = time.perf_counter() - started
        if elapsed >= budget or (config.max_steps is not None and step >= config.max_steps):
            break
        progress = elapsed / budget
        if config.max_steps is not None:
            progress = max(progress, step / config.max_steps)
        n_demo = round(config.batch_size * config.miniwob_fraction) if train_miniwob else 0
        n_desktop = min(
            config.batch_size - n_demo, round(config.batch_size * config.desktop_fraction)
        )
        batch: list[Sample] = [rng.choice(train_miniwob) for _ in range(n_demo)]
        batch += [make_step(rng, scene=draw_scene(rng)) for _ in range(n_desktop)]
        batch += [make_sample(rng) for _ in range(config.batch_size - n_demo - n_desktop)]
        policy.model.train()
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(config, step, progress)
        parts: dict[str, float] = {}
        loss = bc_batch_loss_cached(
            policy,
            batch,
            coords=coords,
            geometry=geometry,
            attention_weight=config.attention_supervision,
            parts=parts,
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
        optimizer.step()
        step += 1
        value = loss.item()
        running = value if running is None else 0.95 * running + 0.05 * value
        if step % 10 == 0:
            terms = {k: round(v, 4) for k, v in parts.items()}
            history.append(
                {"step": step, "seconds": round(elapsed, 1), "loss": round(running, 4), **terms}
            )
        if step % config.eval_every == 0:
            figures = grounding_accuracy(policy, held, coords=coords, geometry=geometry)
            history.append({"step": step, "seconds": round(elapsed, 1), **figures})
            log(f"step {step} {elapsed:.0f}s loss {running:.3f} " + json.dumps(figures))
        elif step % 10 == 0:
            log(f"step {step} {elapsed:.0f}s loss {running:.3f} " + json.dumps(parts))
    seconds = time.perf_counter() - started
    final = grounding_accuracy(policy, held, coords=coords, geometry=geometry)
    log(f"final after {step} steps, {seconds:.0f}s: " + json.dumps(final))
    policy.model.eval()
    policy.model.set_attn_implementation({"text_config": "sdpa"})  # back from eager
    out = save_checkpoint(policy, out_dir)
    return PretrainResult(
        out_dir=out,
        steps=step,
        samples=step * config.batch_size,
        seconds=seconds,
        final_loss=running or float("nan"),
        history=history,
        final_eval=final,
    )


def load_samples(path: str | Path) -> list[GroundingSample]:
    """Samples written by `collect` (a pickle of GroundingSample)."""
    return pickle.loads(Path(path).read_bytes())


def main(argv: list[str]) -> None:
    """`train --out DIR [--demos PATH] [--<config field> V ...]` (demos from
    `python -m envmanager.grounding_screens PATH PER_TASK`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="training.pretrain train")
    parser.add_argument("--out", required=True)
    parser.add_argument("--demos", default="")
    defaults = PretrainConfig()
    for name, value in asdict(defaults).items():
        kind = type(value) if value is not None else int
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    args = vars(parser.parse_args(argv[1:] if argv and argv[0] == "train" else argv))
    out, demos = args.pop("out"), args.pop("demos")
    config = PretrainConfig(**args)
    result = pretrain(
        config=config,
        out_dir=out,
        miniwob=load_samples(demos) if demos else [],
        log=lambda line: print(line, flush=True),
    )
    summary = {"config": asdict(config), **asdict(result), "out_dir": str(result.out_dir)}
    Path(out, "pretrain.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
