"""`python manage.py make_tiny_policy [--out DIR] [--arch qwen2_5_vl]`: build the untrained
tiny Qwen3-VL policy (random weights, a locally trained tokenizer) as a normal Hugging Face
directory. No network.

`--arch qwen2_5_vl` builds a stand-in for a downloaded Qwen2.5-VL / UI-TARS-1.5 checkpoint
instead (default DARTBOARD_HOME/policies/qwen2.5-vl-tiny): Qwen2.5-VL's own classes and
layout (vision blocks attending within 112 px windows with full-attention blocks between,
the patch merger, M-RoPE), CPU-sized widths, and the released model's end tokens
(<|im_end|> in config.json; <|im_end|> and <|endoftext|> in generation_config.json). Serve it
with `rollout.prompt ui-tars-1.5`."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Build the untrained tiny Qwen3-VL policy (default: DARTBOARD_HOME/policies/untrained)."

    def add_arguments(self, parser):
        parser.add_argument("--out", type=Path, default=None)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--force", action="store_true", help="Rebuild even if it exists.")
        parser.add_argument(
            "--arch",
            choices=("qwen3_vl", "qwen2_5_vl"),
            default="qwen3_vl",
            help="qwen3_vl: Dartboard's tiny policy; qwen2_5_vl: a Qwen2.5-VL-layout stand-in "
            "for a downloaded checkpoint.",
        )

    def handle(self, *args, out, seed, force, arch, **options):
        from training.tiny_policy import build_tiny_policy  # deferred: torch costs seconds

        name = "untrained" if arch == "qwen3_vl" else "qwen2.5-vl-tiny"
        out = out or settings.DARTBOARD_HOME / "policies" / name
        if (out / "config.json").exists() and not force:
            self.stdout.write(f"tiny policy already at {out} (use --force to rebuild)")
            return
        if arch == "qwen2_5_vl":
            path = build_tiny_policy(out, seed=seed, **QWEN25_STAND_IN)
        else:
            path = build_tiny_policy(out, seed=seed)
        self.stdout.write(f"built the untrained tiny {arch} policy at {path}")


# Qwen2.5-VL's layout at CPU widths: 4 vision blocks, the 2nd and 4th attending over whole
# images (the released 7B: 7, 15, 23, 31 of 32), the others within windows.
QWEN25_STAND_IN = {"arch": "qwen2_5_vl", "vision_depth": 4, "fullatt_blocks": (1, 3)}
