"""Where a command's CPU goes, by kind of process: every process it starts, to its end.

    .venv/bin/python bench/suite_processes.py [--top 20] [--others 0] [-- COMMAND ...]
    (default: make test)

Runs COMMAND under the kernel's process accounting (`accton`, Debian's `acct`; root), which
records each process's CPU time when it exits, however briefly it lived; a thread looks at
/proc every 0.25 s for the command lines of new processes, so that Python processes can be
told apart (a process that lived less than that is known by its name only). Prints a
markdown table, heaviest first: the kind of process, its CPU seconds over the whole run,
how many processes, and the CPU of one on average; with `--others N`, a second table of the
N heaviest command lines (their first 120 characters) that are of no kind. Run it on an
otherwise idle machine:
accounting records every process on it, not only the command's.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (kind, pattern on the command line, else on the process name), the first that matches.
KINDS = [
    ("inference server zygote", r"-m rollout\.zygote"),
    ("inference server", r"rollout\.server"),
    ("router", r"rollout\.router"),
    ("vLLM", r"vllm|VLLM"),
    ("Celery worker", r"celery"),
    ("pytest (its workers' own tests)", r"pytest|xdist|exec\(eval\(sys\.stdin"),
    ("chromium", r"chrom"),
    ("playwright driver", r"playwright"),
    ("web (dartboard.serve)", r"dartboard\.serve"),
    ("manage.py", r"manage\.py"),
    ("trainer replica", r"training\.replica_group"),
    ("PostgreSQL", r"postgres|pg_ctl|initdb"),
    ("Redis", r"redis"),
    ("S3 server", r"s3_server|moto"),
    ("Xvfb", r"Xvfb"),
    ("bwrap", r"bwrap"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=20, help="kinds in the table")
    parser.add_argument("--others", type=int, default=0,
                        help="also list the N heaviest command lines of no kind")  # fmt: skip
    parser.add_argument("command", nargs="*", default=["make", "test"])
    args = parser.parse_args()
    if shutil.which("accton") is None or os.geteuid() != 0:
        sys.exit("needs root and accton: apt-get install acct")
    record = Path(tempfile.mkdtemp()) / "pacct"
    record.touch()
    commands: dict[int, str] = {}
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(commands, done), daemon=True)
    subprocess.run(["accton", str(record)], check=True, capture_output=True)
    watcher.start()
    try:
        code = subprocess.run(args.command, cwd=ROOT).returncode
    finally:
        subprocess.run(["accton", "off"], check=True, capture_output=True)
        done.set()
        watcher.join()
    cpu: Counter[str] = Counter()
    count: Counter[str] = Counter()
    unkinded: Counter[str] = Counter()
    for pid, name, seconds in _records(record):
        kind = _kind(commands.get(pid, ""), name)
        cpu[kind] += seconds
        count[kind] += 1
        if kind.startswith("other: "):
            unkinded[(commands.get(pid) or f"({name}: gone before it was seen)")[:120]] += seconds
    print(f"`{' '.join(args.command)}` exited with {code}; {sum(cpu.values()):.0f} CPU seconds")
    print("\n| process | CPU (s) | processes | CPU each (s) |\n|---|---:|---:|---:|")
    for kind, seconds in cpu.most_common(args.top):
        print(f"| {kind} | {seconds:.1f} | {count[kind]} | {seconds / count[kind]:.2f} |")
    if args.others:
        print("\n| command line (of no kind) | CPU (s) |\n|---|---:|")
        for command, seconds in unkinded.most_common(args.others):
            print(f"| `{command.strip()}` | {seconds:.1f} |")
    return code


def _watch(commands: dict[int, str], done: threading.Event) -> None:
    while not done.wait(0.25):
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in commands:
                try:
                    raw = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if raw:
                    commands[int(entry)] = raw.replace(b"\0", b" ").decode(errors="replace")


def _records(record: Path) -> list[tuple[int, str, float]]:
    """(pid, name, CPU seconds) of each process that ended while accounting was on."""
    dump = subprocess.run(["dump-acct", str(record)], capture_output=True, text=True, check=True)
    rows = []
    for line in dump.stdout.splitlines():
        fields = [field.strip() for field in line.split("|")]
        # name | version | user | system | elapsed (clock ticks, 100 a second) | ... | pid
        rows.append((int(fields[9]), fields[0], (float(fields[2]) + float(fields[3])) / 100))
    return rows


def _kind(command: str, name: str) -> str:
    if name == "rollout.server":  # forked from a zygote: its command line is the zygote's
        return "inference server"
    for kind, pattern in KINDS:
        if re.search(pattern, command or name):
            return kind
    return f"other: {(command or name).split(' ')[0].rsplit('/', 1)[-1]}"


if __name__ == "__main__":
    sys.exit(main())
