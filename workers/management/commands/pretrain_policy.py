"""`python manage.py pretrain_policy [--out policies/tiny-grounded] [--minutes 30]`: build the
shipped grounded tiny policy. Collects first-step oracle clicks from the 7 easy MiniWoB++
tasks (training seeds, cached under DARTBOARD_HOME/pretrain), behaviour-clones a fresh tiny
Qwen3-VL policy on them mixed with synthetic screens (`training.pretrain`), and writes the
checkpoint with MANIFEST.json (command, data, seed, config, figures)."""

import hashlib
import json
import os
import pickle
import platform
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

MAX_CHECKPOINT_BYTES = 25 * 1024 * 1024


class Command(BaseCommand):
    help = "Pretrain the tiny policy until it grounds clicks; write checkpoint + MANIFEST.json."

    def add_arguments(self, parser):
        parser.add_argument("--out", type=Path, default=Path("policies/tiny-grounded"))
        parser.add_argument("--minutes", type=float, default=30.0)
        parser.add_argument("--per-task", type=int, default=400, help="MiniWoB clicks per task.")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--threads", type=int, default=2)
        parser.add_argument("--batch-size", type=int, default=16)
        parser.add_argument("--lr", type=float, default=1e-3)
        parser.add_argument("--attention-supervision", type=float, default=1.0)
        parser.add_argument(
            "--miniwob-fraction", type=float, default=0.5, help="Share of MiniWoB clicks per batch."
        )
        parser.add_argument(
            "--desktop-fraction",
            type=float,
            default=0.0,
            help="Share of synthetic 800x600 desktop steps per batch (the desktop policy).",
        )
        parser.add_argument(
            "--desktop-scenes",
            default="",
            help="Weights of the desktop scenes, e.g. 'pad:3,drag:2,terminal:3' (default: equal).",
        )
        parser.add_argument("--arch", default="qwen3_vl", choices=["qwen3_vl", "qwen2_5_vl"])
        parser.add_argument(
            "--init", default="", help="Continue from this checkpoint (its MANIFEST is kept)."
        )

    def handle(self, *args, out, minutes, per_task, seed, threads, **options):
        """Long because it applies the command's options in order."""
        # Imported here: torch, transformers and playwright cost seconds, and `--help` and
        # the docs' command reference (hostagent.docs_reference) load this module too.
        from envmanager.grounding_screens import (
            PRETRAIN_TASKS,
            TRAIN_SEED_BASE,
            collect_miniwob_samples,
        )
        from training.pretrain import PretrainConfig, load_samples, pretrain, scene_weights

        if minutes <= 0 or per_task < 0:
            raise CommandError("--minutes must be > 0 and --per-task >= 0")
        shares = options["miniwob_fraction"], options["desktop_fraction"]
        if min(shares) < 0 or sum(shares) > 1:
            raise CommandError(
                f"--miniwob-fraction {shares[0]} and --desktop-fraction {shares[1]}: each must "
                "be >= 0 and together at most 1 (the rest of a batch is synthetic MiniWoB screens)"
            )
        try:
            scenes = scene_weights(options["desktop_scenes"])
        except ValueError as error:
            raise CommandError(f"--desktop-scenes: {error}") from error
        # Keyed by everything that decides the clicks, so another task list or seed range
        # never reuses a stale cache.
        key = hashlib.sha1(f"{','.join(PRETRAIN_TASKS)}|{TRAIN_SEED_BASE}".encode()).hexdigest()
        cache = Path(settings.DARTBOARD_HOME) / "pretrain" / f"miniwob-{per_task}-{key[:10]}.pkl"
        if not options["miniwob_fraction"]:
            demos = []  # no batch draws them: nothing to collect
        elif cache.is_file():
            demos = load_samples(cache)
            self.stdout.write(f"{len(demos)} MiniWoB clicks from {cache}")
        else:
            self.stdout.write(f"collecting {per_task} oracle clicks per task from MiniWoB++ ...")
            demos, stats = collect_miniwob_samples(per_task=per_task)
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_bytes(pickle.dumps(demos))
            self.stdout.write(
                f"{stats.collected} clicks ({stats.skipped} skipped) in {stats.seconds:.0f}s"
            )
        config = PretrainConfig(
            seed=seed,
            minutes=minutes,
            threads=threads,
            batch_size=options["batch_size"],
            lr=options["lr"],
            attention_supervision=options["attention_supervision"],
            miniwob_fraction=options["miniwob_fraction"],
            desktop_fraction=options["desktop_fraction"],
            desktop_scenes=options["desktop_scenes"],
            arch=options["arch"],
            init=str(options["init"]),
        )
        previous = Path(options["init"], "MANIFEST.json") if options["init"] else None
        earlier = json.loads(previous.read_text()) if previous and previous.is_file() else None

        def log(line: str) -> None:
            self.stdout.write(line)
            self.stdout.flush()  # progress shows live when the output goes to a file

        commit = _git_commit()  # the code this run starts from
        # Written beside --out and moved into place only when complete and within the cap, so
        # a failed run never leaves --out (often the --init checkpoint itself) half-replaced.
        staging = out.with_name(out.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        result = pretrain(config=config, out_dir=staging, miniwob=demos, log=log)
        weights = sum(p.stat().st_size for p in staging.glob("*.safetensors"))
        if weights > MAX_CHECKPOINT_BYTES:
            shutil.rmtree(staging, ignore_errors=True)
            raise CommandError(
                f"{out}: weights are {weights / 2**20:.1f} MiB, over the 25 MiB cap; "
                f"{out} is unchanged"
            )
        manifest = {
            "command": "python manage.py " + shlex.join(["pretrain_policy", *sys.argv[2:]]),
            "git_commit": commit,
            "seed": seed,
            "data": {
                "miniwob_tasks": list(PRETRAIN_TASKS),
                "miniwob_clicks_per_task": per_task,
                "miniwob_seeds": f"{TRAIN_SEED_BASE}..{TRAIN_SEED_BASE + per_task - 1}",
                "miniwob_clicks": len(demos),
                "synthetic": "training.synthetic.make_sample, a fresh screen per draw",
                "miniwob_fraction": config.miniwob_fraction,
                "desktop": "training.synthetic_desktop.make_step, a fresh 800x600 episode per draw",
                "desktop_fraction": config.desktop_fraction,
                "desktop_scene_weights": scenes,
            },
            "config": asdict(config),
            "steps": result.steps,
            "samples_seen": result.samples,
            "seconds": round(result.seconds, 1),
            "final_loss": round(result.final_loss, 4),
            "held_out": result.final_eval,
            "machine": f"{platform.machine()}, torch threads {threads}",
            "weights_bytes": weights,
            "continued_from": earlier,  # the manifest of --init, when it had one
        }
        Path(staging, "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        Path(staging, "history.json").write_text(json.dumps(result.history) + "\n")
        # Swap by renames so no moment is without a complete checkpoint at --out or beside it.
        previous_dir = out.with_name(out.name + ".previous")
        shutil.rmtree(previous_dir, ignore_errors=True)
        if out.exists():
            os.replace(out, previous_dir)
        os.replace(staging, out)
        shutil.rmtree(previous_dir, ignore_errors=True)
        self.stdout.write(f"wrote {out} ({weights / 2**20:.1f} MiB) and its MANIFEST.json")


def _git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")
