"""`python manage.py make_tiny_policy [--out DIR]`: build the untrained tiny Qwen3-VL policy
(random weights, a locally trained tokenizer) as a normal Hugging Face directory. No network."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Build the untrained tiny Qwen3-VL policy (default: DARTBOARD_HOME/policies/untrained)."

    def add_arguments(self, parser):
        parser.add_argument("--out", type=Path, default=None)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--force", action="store_true", help="Rebuild even if it exists.")

    def handle(self, *args, out, seed, force, **options):
        from training.tiny_policy import build_tiny_policy  # deferred: torch costs seconds

        out = out or settings.DARTBOARD_HOME / "policies" / "untrained"
        if (out / "config.json").exists() and not force:
            self.stdout.write(f"tiny policy already at {out} (use --force to rebuild)")
            return
        path = build_tiny_policy(out, seed=seed)
        self.stdout.write(f"built the untrained tiny policy at {path}")
