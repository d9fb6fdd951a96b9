"""Where the suite's CPU goes: tests run one at a time, each charged the CPU seconds the whole
machine spent while it ran (its servers, workers, browsers and desktops included).

    .venv/bin/python bench/suite_cpu.py [--top 25] [--out FILE.json] [PYTEST ARGS...]

The default selection is what `make test-fast` leaves out (the live stacks, browsers,
desktops and slow tests). Run it on an otherwise idle machine: the figures are the whole
machine's (/proc/stat), so anything else running is charged to the tests. A module's
fixtures are charged to the test that starts or stops them. Prints a markdown table per
module, heaviest first: CPU seconds, wall seconds, tests; then the totals. `make test` runs
the same tests on three workers at once; on 2 cores its wall time is close to the total CPU
divided by 2 (the CPU is busy 88-100% of the run, `docs/tests.md`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.machine import busy_cpu_s  # noqa: E402

HEAVY = "slow or live or browser or desktop or gpu"


class CpuPerTest:
    """A pytest plugin: (test id, CPU seconds, wall seconds) of each test, setup to teardown."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        cpu, wall = busy_cpu_s(), time.monotonic()
        yield
        self.rows.append((item.nodeid, busy_cpu_s() - cpu, time.monotonic() - wall))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="modules in the table")
    parser.add_argument("--out", type=Path, help="also write every test's row as JSON")
    args, pytest_args = parser.parse_known_args()
    os.chdir(ROOT)
    plugin = CpuPerTest()
    selection = pytest_args or ["-m", HEAVY]
    code = pytest.main(["-q", "-p", "no:xdist", *selection], plugins=[plugin])
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for nodeid, cpu, wall in plugin.rows:
        row = modules[nodeid.split("::")[0]]
        row[0] += cpu
        row[1] += wall
        row[2] += 1
    print("\n| module | CPU (s) | wall (s) | tests |\n|---|---:|---:|---:|")
    for module, (cpu, wall, n) in sorted(modules.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| `{module}` | {cpu:.1f} | {wall:.1f} | {n:.0f} |")
    cpu = sum(r[1] for r in plugin.rows)
    wall = sum(r[2] for r in plugin.rows)
    print(f"| all {len(modules)} modules | {cpu:.1f} | {wall:.1f} | {len(plugin.rows)} |")
    if args.out:
        args.out.write_text(json.dumps(plugin.rows, indent=1))
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
