"""What Dartboard itself adds per environment step, on SQLite and on PostgreSQL.

    .venv/bin/python bench/overhead.py [--steps 300] [--postgres postgres://postgres@127.0.0.1:5432/postgres]

Per step, the platform writes the Step row (and updates its trajectory), stores the
screenshot in media storage, and publishes the live-wall event to Redis after commit; the
request to the policy also passes through the router. Each part is timed on its own and
together (the real `steps_store` service), and compared with a 100 ms environment step.
The PostgreSQL run is skipped (said so) when no server answers.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from rollout.auth import MASTER_ENV, ServiceTokens, bearer, client_token  # noqa: E402


def _png() -> bytes:
    import random

    from PIL import Image

    rng = random.Random(0)
    img = Image.new("RGB", (160, 210), "white")
    for _ in range(40):  # some structure so the PNG is realistic in size (~2-6 KB)
        x, y = rng.randrange(150), rng.randrange(200)
        img.paste(
            (rng.randrange(256), rng.randrange(256), rng.randrange(256)), (x, y, x + 10, y + 8)
        )
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _timeit(fn, n: int) -> float:
    samples = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


def child(steps: int) -> dict:
    """Runs inside a process whose DATABASE_URL is set: time each per-step cost (ms)."""
    import django

    django.setup()
    from django.core.files.base import ContentFile
    from django.core.files.storage import default_storage
    from django.core.management import call_command

    from core.steps import StepRecord
    from datamanager.config import RunConfig
    from datamanager.events import publish
    from datamanager.models import Run, RunStatus, Step, Task, Trajectory
    from datamanager.services import steps
    from datamanager.services.runs import run_create

    call_command("migrate", verbosity=0)
    png = _png()
    task, _ = Task.objects.get_or_create(name="bench/overhead", defaults={"env_kind": "miniwob"})
    run = run_create(name="overhead", config=RunConfig())
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
    traj = Trajectory.objects.create(run=run, task=task)
    kw = dict(
        width=160,
        height=210,
        raw_output="Thought: x\nAction: click(start_box='(10,20)')",
        thought="x",
        action={"type": "click", "x": 10, "y": 20},
        parse_error="",
        prompt_tokens=100,
        response_tokens=20,
        rollout_logprobs=[-0.1] * 20,
        response_token_ids=list(range(20)),
        mean_entropy=0.5,
        policy_version=0,
        env_ms=100.0,
        model_ms=300.0,
    )

    head = steps.trajectory_head(trajectory_id=traj.pk)  # read once per episode by a slot

    def full(i):
        record = StepRecord(index=i, screenshot_png=png, **kw)
        steps.steps_store(writes=[steps.StepWrite(head=head, record=record)])

    def row_only(i):
        Step.objects.create(
            trajectory=traj,
            index=10_000 + i,
            raw_output=kw["raw_output"],
            action=kw["action"],
            rollout_logprobs=kw["rollout_logprobs"],
        )
        Trajectory.objects.filter(pk=traj.pk).update(length=i + 1)

    def storage(i):
        default_storage.save(f"bench/{i}.png", ContentFile(png))

    def event(i):
        publish(
            run_id=run.pk,
            kind="step",
            data={"slot": 1, "trajectory": traj.pk, "step": i, "image": f"/media/bench/{i}.png"},
        )

    return {
        "steps_store (all of it)": _timeit(full, steps),
        "  database rows": _timeit(row_only, steps),
        "  screenshot storage": _timeit(storage, steps),
        "  live event publish": _timeit(event, steps),
        "png bytes": len(png),
    }


def routing_overhead(n: int) -> dict | None:
    """What the router adds to a 1-token request to a real inference worker (median ms)."""
    from rollout.local_server import LocalPolicyServer, free_port

    home = Path(os.environ["DARTBOARD_HOME"])
    policy = home / "policies" / "untrained"
    if not (policy / "config.json").exists():
        from training.tiny_policy import build_tiny_policy

        build_tiny_policy(policy)
    from core.prompts import build_messages

    messages = build_messages(instruction="Click OK", history=[], screenshots=[_png()])
    with LocalPolicyServer(policy) as url:
        port = free_port()
        router = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollout.router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker",
                url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            from hostagent.launcher import wait_http

            if not wait_http(f"http://127.0.0.1:{port}/health", timeout=60):
                return None
            return _router_cost(f"http://127.0.0.1:{port}", messages, n)
        finally:
            router.terminate()
            router.wait()


def _router_cost(router: str, messages: list, n: int) -> dict:
    """Per request: client-observed latency through the router minus the time the router
    spent waiting on the worker (its X-Dartboard-Upstream-Ms header). The difference is what
    the hop adds (parsing, routing, a second connection, re-encoding), free of the model's
    own latency noise, which is much larger than the hop."""
    import httpx

    body = {"model": "policy", "messages": messages, "max_tokens": 1, "logprobs": True}
    added, totals = [], []
    with httpx.Client(timeout=60, headers=bearer(client_token(None))) as http:
        http.post(f"{router}/v1/chat/completions", json=body).raise_for_status()  # warm up
        for _ in range(n):
            started = time.perf_counter()
            response = http.post(f"{router}/v1/chat/completions", json=body)
            total = (time.perf_counter() - started) * 1000
            response.raise_for_status()
            totals.append(total)
            added.append(total - float(response.headers["X-Dartboard-Upstream-Ms"]))
    return {"router_added": statistics.median(added), "request": statistics.median(totals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432/dartboard_bench")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.steps)))
        return

    home = Path(tempfile.mkdtemp(prefix="dartboard-overhead-"))
    # The rollout service demands its tokens; the servers and clients here share these.
    os.environ.setdefault(MASTER_ENV, secrets.token_urlsafe(32))
    for name, value in ServiceTokens.derived(os.environ[MASTER_ENV]).environ().items():
        os.environ.setdefault(name, value)
    env = {
        **os.environ,
        "DARTBOARD_HOME": str(home),
        "DJANGO_SETTINGS_MODULE": "dartboard.settings",
    }
    env.pop("DATABASE_URL", None)
    from hostagent.embedded_redis import EmbeddedRedis

    redis = EmbeddedRedis(home / "redis" / "redis.sock")
    redis.start()
    env.pop("REDIS_URL", None)
    results = {}
    try:
        for label, url in (("SQLite", None), ("PostgreSQL", args.postgres)):
            child_env = dict(env)
            if url:
                if not _ensure_pg_db(url):
                    print(f"{label}: skipped (no server at {url})")
                    continue
                child_env["DATABASE_URL"] = url
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--steps", str(args.steps)],
                env=child_env,
                capture_output=True,
                text=True,
                check=True,
            )
            results[label] = json.loads(out.stdout.strip().splitlines()[-1])
        os.environ.update({"DARTBOARD_HOME": str(home)})
        routing = routing_overhead(50)
    finally:
        redis.stop()

    print(
        f"\nper-step platform overhead, median of {args.steps} steps (ms; % of a 100 ms env step)"
    )
    labels = [k for k in next(iter(results.values())) if k != "png bytes"]
    print("| component | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for key in labels:
        cells = [f"{r[key]:.2f} ({r[key]:.1f}%)" for r in results.values()]
        print(f"| {key} | " + " | ".join(cells) + " |")
    if routing:
        extra = routing["router_added"]
        print(
            f"| router hop (added to a {routing['request']:.0f} ms 1-token request; both "
            f"backends) | {extra:.2f} ({extra:.1f}%) |"
        )
    print(f"screenshot size: {next(iter(results.values()))['png bytes']} bytes")


def _ensure_pg_db(url: str) -> bool:
    try:
        import psycopg
    except ImportError:
        return False
    base, name = url.rsplit("/", 1)
    try:
        with psycopg.connect(base + "/postgres", autocommit=True, connect_timeout=3) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{name}"')
        return True
    except psycopg.OperationalError:
        return False


if __name__ == "__main__":
    main()
