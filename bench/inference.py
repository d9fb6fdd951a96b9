"""Throughput and latency of the transformers inference server, batching on and off.

    .venv/bin/python -m bench.inference [--policy DIR] [--seconds 8] [--max-tokens 40]
        [--max-batch 8] [--max-wait-ms 50] [--threads 1]

Starts rollout.server in a subprocess (the tiny policy is built in a temporary directory
unless --policy is given), drives it with 1, 4 and 8 concurrent PolicyClients sending a
160x210 screenshot step each, and prints a markdown table: requests/s, generated tokens/s
and latency median / p90 per setting, and the batched/unbatched throughput ratio.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from PIL import Image, ImageDraw

from rollout.auth import ServiceTokens
from rollout.client import PolicyClient

ROOT = Path(__file__).resolve().parents[1]


def step_messages() -> list[dict]:
    image = Image.new("RGB", (160, 210), "white")
    ImageDraw.Draw(image).rectangle([20, 150, 100, 180], fill="blue")
    buf = io.BytesIO()
    image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [
        {"role": "system", "content": "You are a GUI agent."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Click the submit button."},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        },
    ]


@contextmanager
def running_server(policy: Path, *, port: int, extra: list[str]):
    cmd = [sys.executable, "-m", "rollout.server", "--policy", str(policy), "--port", str(port)]
    proc = subprocess.Popen(cmd + extra, cwd=ROOT, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server {' '.join(cmd + extra)} did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def drive(url: str, *, clients: int, seconds: float, max_tokens: int) -> dict[str, float]:
    """`clients` closed-loop clients for `seconds`; latencies of requests finished in time."""
    messages = step_messages()
    latencies: list[float] = []
    tokens: list[int] = []
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()

    def loop() -> None:
        with PolicyClient(url, timeout=120) as client:
            while time.monotonic() < stop_at:
                c = client.complete(messages, max_tokens=max_tokens, temperature=1.0)
                with lock:
                    latencies.append(c.latency_ms)
                    tokens.append(c.response_tokens)

    before = httpx.get(f"{url}/health").json()
    started = time.monotonic()
    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    after = httpx.get(f"{url}/health").json()
    batches = after["batches_run"] - before["batches_run"]
    latencies.sort()
    return {
        "rps": len(latencies) / elapsed,
        "tps": sum(tokens) / elapsed,
        "p50": statistics.median(latencies),
        "p90": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
        "n": len(latencies),
        "batch": (after["requests_served"] - before["requests_served"]) / max(1, batches),
    }


def main() -> None:
    # The server demands the inference and admin tokens; this bench's clients send them.
    for name, value in ServiceTokens.fresh().environ().items():
        os.environ.setdefault(name, value)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-wait-ms", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--port", type=int, default=8191)
    parser.add_argument("--clients", default="1,4,8", help="comma-separated client counts")
    parser.add_argument("--modes", default="batching,no batching", help="which settings to run")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        policy = args.policy
        if policy is None:
            from training.tiny_policy import build_tiny_policy

            policy = build_tiny_policy(Path(tmp) / "tiny")
        settings = {
            "batching": [
                "--max-batch",
                str(args.max_batch),
                "--max-wait-ms",
                str(args.max_wait_ms),
            ],
            "no batching": ["--no-batching"],
        }
        rows = []
        for name, extra in settings.items():
            if name not in args.modes.split(","):
                continue
            with running_server(
                policy, port=args.port, extra=[*extra, "--threads", str(args.threads)]
            ) as url:
                drive(url, clients=2, seconds=2, max_tokens=args.max_tokens)  # warm-up
                for clients in [int(c) for c in args.clients.split(",")]:
                    r = drive(
                        url, clients=clients, seconds=args.seconds, max_tokens=args.max_tokens
                    )
                    rows.append((name, clients, r))
                    print(f"{name:12s} clients={clients} {r}", file=sys.stderr, flush=True)

    print(
        f"\nmax_tokens={args.max_tokens}, max_batch={args.max_batch}, "
        f"max_wait_ms={args.max_wait_ms}, torch threads={args.threads}\n"
    )
    print(
        "| mode | clients | requests/s | tokens/s | latency p50 (ms) | latency p90 (ms) "
        "| requests | mean batch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, clients, r in rows:
        print(
            f"| {name} | {clients} | {r['rps']:.2f} | {r['tps']:.0f} | {r['p50']:.0f} "
            f"| {r['p90']:.0f} | {r['n']:.0f} | {r['batch']:.1f} |"
        )
    by = {(name, c): r["rps"] for name, c, r in rows}
    if ("batching", 8) in by and ("no batching", 8) in by:
        ratio = by[("batching", 8)] / by[("no batching", 8)]
        print(f"\nbatching / no batching throughput at 8 clients: {ratio:.2f}x")


if __name__ == "__main__":
    main()
