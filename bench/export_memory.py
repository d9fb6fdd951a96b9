"""A dataset export's peak memory against its size: `manage.py export_dataset` over 1,000 and
10,000 trajectories, in a private home on SQLite; each export in its own process, so its peak
resident memory is its own.

    .venv/bin/python bench/export_memory.py                     # 1,000 and 10,000 trajectories
    .venv/bin/python bench/export_memory.py --sizes 200 --formats hf,sft,osworld

Each trajectory has --steps steps (default 3); each step's screenshot is one of 8 stored
640x360 PNGs (about 60 KB each, screen-like content, not compressible to nothing), so the
export reads a screenshot per step as a real one does. Streaming holds: the peak is about
the same at every size.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOTS = 8


def _screens() -> list[bytes]:
    from PIL import Image, ImageDraw

    out = []
    for i in range(SHOTS):
        img = Image.new("RGB", (640, 360), (240 - 20 * i, 240, 250))
        draw = ImageDraw.Draw(img)
        for row in range(0, 360, 18):  # text-like lines, different on each screen
            draw.text((8 + 3 * i, row), f"row {row} of screen {i} " * 4, fill=(20, 20, 20))
        buf = io.BytesIO()
        img.save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def fill(trajectories: int, steps: int) -> None:
    """Precollected trajectories with their steps, bulk-inserted."""
    from django.core.files.base import ContentFile
    from django.core.files.storage import default_storage

    from datamanager.models import Step, Task, Trajectory, TrajectorySource, TrajectoryStatus

    keys = [default_storage.save(f"screenshots/bench/traj-1/{i}.png", ContentFile(png))
            for i, png in enumerate(_screens())]  # fmt: skip
    task = Task.objects.create(name="bench/export", env_kind="miniwob", instruction="Click OK")
    batch = 1000
    for start in range(0, trajectories, batch):
        n = min(batch, trajectories - start)
        trajs = Trajectory.objects.bulk_create([
            Trajectory(task=task, status=TrajectoryStatus.SUCCEEDED if k % 2 == 0 else TrajectoryStatus.FAILED,
                       reward=1.0 if k % 2 == 0 else 0.0, length=steps, source=TrajectorySource.PRECOLLECTED,
                       instruction="Click OK")
            for k in range(n)])  # fmt: skip
        Step.objects.bulk_create([
            Step(trajectory=t, index=j, screenshot=keys[(t.pk + j) % SHOTS], screen_width=640, screen_height=360,
                 raw_output="Action: click(start_box='<|box_start|>(40,80)<|box_end|>')",
                 action={"type": "click", "x": 40, "y": 80}, thought="The OK button")
            for t in trajs for j in range(steps)])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,10000", help="trajectories per export")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--formats", default="hf,sft")
    ap.add_argument("--child-fill", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-export", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_fill or args.child_export:
        sys.path.insert(0, str(ROOT))
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
        import django

        django.setup()
        if args.child_fill:
            fill(*args.child_fill)
            return
        from django.core.management import call_command

        call_command("export_dataset", args.child_export, "--formats", args.formats)
        print(f"PEAK_KB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}")
        return
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory(prefix="export-bench-") as home:
            env = {**os.environ, "DARTBOARD_HOME": home, "DATABASE_URL": ""}
            env.pop("DATABASE_URL")
            py = [sys.executable]
            subprocess.run([*py, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
            subprocess.run([*py, __file__, "--child-fill", str(size), str(args.steps)],
                           cwd=ROOT, env=env, check=True)  # fmt: skip
            out = Path(home) / "export"
            started = time.perf_counter()
            done = subprocess.run([*py, __file__, "--child-export", str(out), "--formats", args.formats],
                                  cwd=ROOT, env=env, check=True, capture_output=True, text=True)  # fmt: skip
            seconds = time.perf_counter() - started
            peak_kb = int(done.stdout.rsplit("PEAK_KB", 1)[1].split()[0])
            size_mb = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
            rows.append((size, size * args.steps, size_mb, seconds, peak_kb / 1024))
    print(
        f"\nexport_dataset --formats {args.formats}, {args.steps} steps a trajectory, 640x360 screenshots"
    )
    print("| trajectories | steps | export size | time | peak RSS of the export process |")
    print("|---:|---:|---:|---:|---:|")
    for size, steps, mb, seconds, peak in rows:
        print(f"| {size:,} | {steps:,} | {mb:,.0f} MB | {seconds:.0f} s | {peak:,.0f} MB |")


if __name__ == "__main__":
    main()
