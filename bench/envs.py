"""Environment backend throughput: reset/step latency, steps/s and memory for 1, 2, 4 slots.

Each slot is a separate process owning one env (as an env worker does) and runs oracle
episodes (falling back to random clicks when the oracle has nothing to do) for --seconds.
Memory is the PSS (proportional RSS, shared pages split) of the slot's browser / X process tree (not the Python process).

`osworld`: each slot starts its own Dartboard desktop serving OSWorld's protocol
(`python -m envmanager.osworld_server`, its own process like a VM) and drives it with the
osworld backend over HTTP (the wheel's PythonController/SetupController, the 12 tasks of
tasks/osworld/); its memory is the server's tree (server, Xvfb, openbox, sandboxed apps).

    .venv/bin/python bench/envs.py --seconds 10 --slots 1 2 4 --backends miniwob desktop osworld
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MINIWOB_TASKS = ["click-test", "click-button", "click-link", "enter-text", "click-checkboxes"]
DESKTOP_TASKS = ["desktop/double-click", "desktop/right-click", "desktop/editor-type-save"]


def _tree_rss_mib(pids: list[int]) -> float:
    import psutil

    total = 0
    for pid in set(pids):
        try:
            total += psutil.Process(pid).memory_full_info().pss  # PSS: shared pages split
        except psutil.Error:
            continue
    return total / 2**20


def _slot(backend: str, seconds: float, seed: int, out: mp.Queue) -> None:
    from core.protocol import Action, ActionType, TaskSpec
    from envmanager.oracles import oracle_action

    rng = random.Random(seed)
    if backend == "miniwob":
        import psutil

        from envmanager.miniwob_env import MiniWoBEnv

        env = MiniWoBEnv()
        names = [f"miniwob/{t}" for t in MINIWOB_TASKS]

        def pids() -> list[int]:
            pid = env.browser_pid()
            if pid is None:
                return []
            return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]

        def spec(name: str) -> TaskSpec:
            task = name.removeprefix("miniwob/")
            return TaskSpec(
                name=name, env_kind="miniwob", env_config={"task": task}, seed=rng.randrange(10**6)
            )
    elif backend == "osworld":
        env, names, pids, spec = _osworld_slot(seed)
    else:
        from envmanager.desktop_env import DesktopEnv

        env = DesktopEnv(evaluate_wait_s=0.2)
        names = DESKTOP_TASKS
        pids = env.process_pids

        def spec(name: str) -> TaskSpec:
            return TaskSpec(name=name, env_kind="desktop", env_config={"task": name})

    resets, steps, rewards, rss = [], [], [], []
    try:
        env.reset(spec(names[0]))  # warm-up: browser / X start is not part of the figures
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            name = rng.choice(names)
            started = time.perf_counter()
            obs = env.reset(spec(name))
            resets.append(time.perf_counter() - started)
            for _ in range(15):
                action = oracle_action(env_kind=env.kind, task_name=name, observation=obs)
                if action is None or action.type == ActionType.FINISHED:
                    break
                started = time.perf_counter()
                obs = env.step(action)
                steps.append(time.perf_counter() - started)
            rewards.append(env.evaluate().reward)
            rss.append(_tree_rss_mib(pids()))
            if not steps:  # keep the random fallback reachable for odd tasks
                env.step(Action(type=ActionType.CLICK, x=rng.randrange(100), y=rng.randrange(100)))
    finally:
        env.close()
        if backend == "osworld":
            _SERVERS.pop().terminate()
    out.put({"resets": resets, "steps": steps, "rewards": rewards, "rss": max(rss or [0.0])})


_SERVERS: list = []


def _osworld_slot(seed: int):
    """(env, task names, pids(), spec()) of one OSWorld-protocol desktop started for this slot."""
    import json
    import os
    import secrets
    import subprocess

    import psutil

    from core.protocol import TaskSpec
    from envmanager.osworld_env import OSWorldEnv
    from envmanager.osworld_oracles import osworld_task_files

    token = secrets.token_urlsafe(16)
    root = Path(__file__).resolve().parents[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "envmanager.osworld_server", "--port", "0"],
        cwd=root,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(root), "DARTBOARD_DESKTOP_TOKEN": token},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    _SERVERS.append(server)
    address = server.stdout.readline().split(" on ")[1].split()[0]
    env = OSWorldEnv(address=address, token=token, settle_s=0.15)
    tasks = {f"osworld/{json.loads(p.read_text())['id']}": p for p in osworld_task_files()}

    def pids() -> list[int]:
        proc = psutil.Process(server.pid)
        return [server.pid, *(c.pid for c in proc.children(recursive=True))]

    def spec(name: str) -> TaskSpec:
        data = json.loads(tasks[name].read_text())
        return TaskSpec(name, "osworld", {"osworld": data}, data["instruction"])

    return env, sorted(tasks), pids, spec


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run(backend: str, slots: int, seconds: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_slot, args=(backend, seconds, i, queue)) for i in range(slots)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    resets = [x for r in results for x in r["resets"]]
    steps = [x for r in results for x in r["steps"]]
    rewards = [x for r in results for x in r["rewards"]]
    return {
        "reset_med": statistics.median(resets) * 1000,
        "reset_p90": _pct(resets, 0.9) * 1000,
        "step_med": statistics.median(steps) * 1000,
        "step_p90": _pct(steps, 0.9) * 1000,
        "steps_per_s": (len(steps) + len(resets)) / seconds,
        "episodes": len(rewards),
        "success": sum(rewards) / max(1, len(rewards)),
        "rss_per_slot": sum(r["rss"] for r in results) / len(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring time per row")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--backends", nargs="+", default=["miniwob", "desktop"])
    args = parser.parse_args()
    print(
        "| backend | slots | reset ms (med / p90) | step ms (med / p90) | env calls/s (all slots) "
        "| episodes | oracle success | MiB per slot |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for backend in args.backends:
        for slots in args.slots:
            r = run(backend, slots, args.seconds)
            print(
                f"| {backend} | {slots} | {r['reset_med']:.0f} / {r['reset_p90']:.0f} "
                f"| {r['step_med']:.0f} / {r['step_p90']:.0f} | {r['steps_per_s']:.1f} "
                f"| {r['episodes']} | {r['success']:.2f} | {r['rss_per_slot']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
