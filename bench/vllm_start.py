"""vLLM's start and first requests on this CPU, as the launcher starts it, eager (the launcher's
setting on vLLM's CPU build, `rollout.vllm_command.vllm_environment`) against compiled.

    .venv/bin/python bench/vllm_start.py [--repeats 5]

For the shipped tiny policy and the Qwen2.5-VL stand-in (built in a temporary directory),
starts vLLM with the launcher's arguments and environment (`hostagent.launcher.vllm_specs`),
then sends the chat request a rollout step sends (a screenshot, greedy, 40 tokens, the
chosen token's log-prob), `--repeats` times. Prints a markdown table: seconds to the first
/v1/models answer, the first request's wall time and the CPU seconds the machine spent on it,
and the median of the later ones. "compiled" drops TORCHDYNAMO_DISABLE from the environment.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def chat_body(png: bytes) -> bytes:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "Click the box labelled 2."}]  # fmt: skip
    return json.dumps({
        "model": "policy", "messages": [{"role": "user", "content": content}],
        "max_tokens": 40, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 1,
    }).encode()  # fmt: skip


def measure(policy: Path, *, compiled: bool, repeats: int, png: bytes) -> dict[str, float]:
    from bench.machine import busy_cpu_s
    from hostagent.launcher import vllm_specs
    from rollout.auth import VLLM_KEY_ENV, ServiceTokens
    from rollout.limits import ServingLimits

    tokens = ServiceTokens.derived(secrets.token_urlsafe(32))  # the adapter's: not started here
    specs = vllm_specs(
        0,
        str(policy),
        0,
        tokens=tokens,
        prefix="bench-",
        limits=ServingLimits(max_prompt_tokens=3072, max_images=1),
    )
    serve = specs[0]
    env = dict(serve.env)
    if compiled:
        env.pop("TORCHDYNAMO_DISABLE", None)
    sock = Path(serve.argv[serve.argv.index("--uds") + 1])
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock.unlink(missing_ok=True)
    curl = ["curl", "-s", "--unix-socket", str(sock),
            "-H", f"Authorization: Bearer {env[VLLM_KEY_ENV]}"]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(serve.argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        while subprocess.run(
            [*curl, "-f", "http://vllm/v1/models"], capture_output=True
        ).returncode:
            if proc.poll() is not None or time.monotonic() - started > 600:
                raise SystemExit(f"vLLM did not start for {policy}")
            time.sleep(0.25)
        ready = time.monotonic() - started
        post = [*curl, "-f", "-H", "Content-Type: application/json", "--data-binary", "@-",
                "http://vllm/v1/chat/completions"]  # fmt: skip
        walls, cpus = [], []
        for _ in range(repeats):
            cpu0, t0 = busy_cpu_s(), time.monotonic()
            subprocess.run(post, input=chat_body(png), capture_output=True, check=True)
            walls.append(time.monotonic() - t0)
            cpus.append(busy_cpu_s() - cpu0)
    finally:
        os.killpg(proc.pid, 2)  # SIGINT: vLLM's own shutdown, its engine processes with it
        proc.wait(timeout=120)
    return {"ready": ready, "first": walls[0], "first_cpu": cpus[0],
            "later": statistics.median(walls[1:]), "later_cpu": statistics.median(cpus[1:])}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
    import django

    with tempfile.TemporaryDirectory() as home:
        os.environ["DARTBOARD_HOME"] = home
        django.setup()
        from core.protocol import TaskSpec
        from datamanager.policies import SHIPPED_POLICY
        from envmanager.sim_env import SimEnv
        from training.tiny_policy import build_tiny_policy
        from workers.management.commands.make_tiny_policy import QWEN25_STAND_IN

        task = TaskSpec(name="sim/click-3", env_kind="sim", env_config={"targets": 3}, seed=0)
        png = SimEnv().reset(task).screenshot_png
        qwen25 = build_tiny_policy(Path(home) / "qwen2.5-vl-tiny", seed=0, **QWEN25_STAND_IN)
        print(
            "| policy | vLLM | ready (s) | first request (s) | its CPU (s) "
            "| later requests, median (s) | their CPU (s) |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, policy in (("tiny-grounded", SHIPPED_POLICY), ("Qwen2.5-VL stand-in", qwen25)):
            for compiled in (False, True):
                m = measure(Path(policy), compiled=compiled, repeats=args.repeats, png=png)
                print(f"| {name} | {'compiled' if compiled else 'eager'} | {m['ready']:.1f} "
                      f"| {m['first']:.2f} | {m['first_cpu']:.1f} | {m['later']:.2f} "
                      f"| {m['later_cpu']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
