"""How long Ctrl-C takes to stop the main job: `manage.py run_dartboard` (make run's launcher)
in a private DARTBOARD_HOME, SIGINT after `--after` seconds of running, the time until the
launcher has exited, and the processes it had to kill ("did not stop in time").

    .venv/bin/python bench/stop_time.py --after 90 150 210

Each round starts from an empty home (a fresh run), so the moment of the Ctrl-C falls in a
different phase: the first evaluation, training, a later evaluation.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_round(after_s: float, port: int) -> tuple[float, list[str]]:
    """Seconds from SIGINT to the launcher's exit, and its "did not stop in time" lines."""
    with tempfile.TemporaryDirectory(prefix="dartboard-stop-") as home:
        log = Path(home) / "launcher.log"
        with log.open("w") as out:
            launcher = subprocess.Popen(
                [sys.executable, "manage.py", "run_dartboard", "--port", str(port)],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "DARTBOARD_HOME": home},
            )  # fmt: skip
            try:
                time.sleep(after_s)
                started = time.monotonic()
                launcher.send_signal(signal.SIGINT)
                launcher.wait(timeout=600)
                seconds = time.monotonic() - started
            finally:
                if launcher.poll() is None:
                    launcher.kill()
                    launcher.wait()
        killed = [line for line in log.read_text().splitlines() if "did not stop in time" in line]
        return seconds, killed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--after", type=float, nargs="+", default=[90, 150, 210],
                    help="seconds of running before each round's Ctrl-C")  # fmt: skip
    ap.add_argument("--port", type=int, default=8011)
    args = ap.parse_args()
    print("| Ctrl-C after | stopped in | processes killed |\n|---:|---:|---|")
    for after in args.after:
        seconds, killed = one_round(after, args.port)
        names = "; ".join(k.split(" did not")[0].rsplit(" ", 1)[-1] for k in killed) or "none"
        print(f"| {after:.0f} s | {seconds:.1f} s | {names} |", flush=True)


if __name__ == "__main__":
    main()
