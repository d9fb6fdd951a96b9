"""This machine's own figures, for benches that charge work the whole machine's CPU."""

from __future__ import annotations

import os


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (user, nice, system, irq, softirq, steal;
    /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")
