"""What torch processes sharing too few cores cost, by how their threads wait.

    .venv/bin/python bench/omp_wait.py [--processes 3] [--steps 2000]

Starts `--processes` processes at once, each doing the same small torch work (a 256x256
matmul and a softmax, `--steps` times: the size of the tiny policy's layers), for each
setting: 1 thread; 2 threads with libgomp's default waiting (its threads spin between
parallel regions); 2 threads with `OMP_WAIT_POLICY=PASSIVE` (they sleep). Prints a markdown
table: the CPU seconds each process spent (mean) and the wall seconds until the last ended.
Run it on an otherwise idle machine: the processes are meant to compete only with each
other. `make test` sets PASSIVE for every process it starts (tests/settings.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

WORK = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.randn(256, 256)
start = time.process_time()
for _ in range(int(sys.argv[2])):
    torch.softmax(a @ a, -1)
print(time.process_time() - start)
"""

SETTINGS = (
    ("1 thread", 1, None),
    ("2 threads, default waiting (spinning)", 2, None),
    ("2 threads, OMP_WAIT_POLICY=PASSIVE", 2, "PASSIVE"),
)


def measure(processes: int, threads: int, policy: str | None, steps: int) -> tuple[float, float]:
    """(mean CPU seconds per process, wall seconds) for `processes` at once."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    argv = [sys.executable, "-c", WORK, str(threads), str(steps)]
    started = time.monotonic()
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for _ in range(processes)
    ]
    cpu = [float(p.communicate()[0]) for p in procs]
    return sum(cpu) / len(cpu), time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    print(f"{args.processes} processes at once on {os.cpu_count()} cores, {args.steps} steps each")
    print()
    print("| threads and waiting | CPU per process (s) | wall (s) |")
    print("|---|---:|---:|")
    for name, threads, policy in SETTINGS:
        cpu, wall = measure(args.processes, threads, policy, args.steps)
        print(f"| {name} | {cpu:.2f} | {wall:.2f} |")


if __name__ == "__main__":
    main()
