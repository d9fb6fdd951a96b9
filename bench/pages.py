"""Dashboard page load times on a large run: 10,000 trajectories and 200,000 steps.

Run: `.venv/bin/python bench/pages.py [--trajectories 10000] [--steps 20] [--screenshots DIR]`

Fills a fresh SQLite database under a temporary DARTBOARD_HOME (bulk_create; screenshots
are a dozen small real PNGs the steps share), then times each page with Django's test
Client, logged in (median of --repeat requests), and prints a markdown table. With
--screenshots it also serves the same data with daphne and saves a PNG of each page
(headless chromium via Playwright) for the README.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["click-button", "click-checkboxes", "enter-text", "login-user", "choose-list",
         "click-tab", "focus-text", "use-autocomplete", "search-engine", "email-inbox",
         "click-dialog", "navigate-tree", "social-media", "book-flight", "click-link",
         "enter-date"]  # fmt: skip
ACTIONS = [
    {"type": "click", "x": 80, "y": 120},
    {"type": "type", "text": "Kanesha"},
    {"type": "drag", "x": 30, "y": 100, "x2": 130, "y2": 150},
    {"type": "scroll", "x": 80, "y": 140, "direction": "down"},
    {"type": "hotkey", "key": "enter"},
    {"type": "left_double", "x": 60, "y": 90},
]


def _setup(home: Path) -> None:
    os.environ["DARTBOARD_HOME"] = str(home)
    os.environ["DJANGO_SETTINGS_MODULE"] = "dartboard.settings"
    for var in ("DATABASE_URL", "REDIS_URL", "DARTBOARD_ENV"):
        os.environ.pop(var, None)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _gui_png(seed: int) -> bytes:
    """A MiniWoB-looking 160x210 screenshot: an instruction bar, a form, a button."""
    from PIL import Image, ImageDraw

    rnd = random.Random(seed)
    img = Image.new("RGB", (160, 210), (255, 255, 255))
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, 160, 50], fill=(255, 255, 176))
    d.text((4, 6), TASKS[seed % len(TASKS)].replace("-", " "), fill=(0, 0, 0))
    d.text((4, 22), f"Select item {rnd.randint(1, 9)} and submit", fill=(60, 60, 60))
    for i in range(3):
        y = 62 + i * 28
        d.rectangle([10, y, 150, y + 20], outline=(150, 150, 150))
        d.text((14, y + 5), rnd.choice(["Kanesha", "Ohio", "blue", "42", "Mon"]), fill=(0, 0, 0))
    d.rectangle([40, 160, 120, 185], fill=(rnd.randint(40, 90), 110, 220))
    d.text((64, 167), "Submit", fill=(255, 255, 255))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _without_auto_now(models_fields):
    for model, name in models_fields:
        model._meta.get_field(name).auto_now_add = False


def fill(*, n_traj: int, steps_per: int, seed: int = 0) -> int:
    """Create one big run (and a small one) with realistic shapes. Returns the run id."""
    from django.contrib.auth.models import User
    from django.core.files.base import ContentFile
    from django.core.files.storage import default_storage
    from django.db import transaction
    from django.utils import timezone

    from datamanager.config import RunConfig
    from datamanager.models import (
        EnvSlot,
        PolicyVersion,
        Run,
        Step,
        Task,
        TaskStat,
        TaskStatHistory,
        TrainUpdate,
        Trajectory,
    )  # fmt: skip

    _without_auto_now([(Trajectory, "started_at"), (Step, "created_at"),
                       (TaskStatHistory, "at"), (TrainUpdate, "created_at")])  # fmt: skip
    rnd = random.Random(seed)
    from datamanager.roles import role_group

    ada = User.objects.create_user("ada", password="lovelace-pass-1")
    ada.groups.add(role_group("viewer"))  # every page needs a role (README, Security model)
    shots = [
        default_storage.save(f"bench/{i:02d}.png", ContentFile(_gui_png(i))) for i in range(12)
    ]
    tasks = Task.objects.bulk_create(
        [Task(name=n, env_kind="miniwob", instruction=n.replace("-", " ")) for n in TASKS]
    )
    skill = {t.pk: rnd.uniform(0.05, 0.95) for t in tasks}
    now = timezone.now()
    start = now - timedelta(hours=5)
    cfg = RunConfig.from_dict({"env": {"miniwob_slots": 8}, "curation": {"n_max": 8}})
    with transaction.atomic():
        run = Run.objects.create(name="miniwob-16 decoupled", config=cfg.to_dict(), status="running",
                                 started_at=start)  # fmt: skip
        Run.objects.create(name="miniwob-16 synchronous baseline", status="stopped",
                           config={**cfg.to_dict(), "mode": "synchronous"},
                           started_at=start, finished_at=now - timedelta(hours=2))  # fmt: skip
        slots = EnvSlot.objects.bulk_create(
            [
                EnvSlot(
                    name=f"worker-1:{4100 + i // 4}:{i % 4}",
                    host="worker-1",
                    backend="miniwob",
                    run=run,
                    status="busy",
                )
                for i in range(8)
            ]
        )
        span = (now - start).total_seconds()
        trajs = []
        for i in range(n_traj):
            task = tasks[i % len(tasks)]
            t0 = start + timedelta(seconds=span * i / n_traj)
            ok = rnd.random() < min(0.95, skill[task.pk] + 0.4 * i / n_traj)
            running = i >= n_traj - len(slots)
            length = steps_per
            trajs.append(Trajectory(
                run=run, task=task, env_slot=slots[i % len(slots)], started_at=t0,
                finished_at=None if running else t0 + timedelta(seconds=length * 1.7),
                status="running" if running else ("succeeded" if ok else "failed"),
                reward=None if running else float(ok), length=length,
                policy_versions=[i * 50 // n_traj], instruction=task.instruction, step_cap=15,
                in_pool=ok and i % 97 == 0,
            ))  # fmt: skip
        trajs = Trajectory.objects.bulk_create(trajs, batch_size=2000)
        batch = []
        for ti, traj in enumerate(trajs):
            for j in range(steps_per):
                a = ACTIONS[(ti + j) % len(ACTIONS)]
                batch.append(Step(
                    trajectory_id=traj.pk, index=j, screenshot=shots[(ti + j) % len(shots)],
                    screen_width=160, screen_height=210, action=a,
                    raw_output=f"Thought: step {j}\nAction: {a['type']}(...)",
                    thought=f"I should {a['type']} next.", prompt_tokens=600, response_tokens=24,
                    rollout_logprobs=[-0.3, -0.1, -0.05], mean_entropy=rnd.uniform(0.1, 1.5),
                    policy_version=traj.policy_versions[0], env_ms=rnd.uniform(30, 100),
                    model_ms=rnd.uniform(80, 400), created_at=traj.started_at + timedelta(seconds=1.7 * j),
                    entropy_kept=rnd.random() < 0.8, advantage=rnd.uniform(-1, 1),
                    is_weight=min(1.0, rnd.uniform(0.7, 1.3)),
                ))  # fmt: skip
            if len(batch) >= 20000:
                Step.objects.bulk_create(batch, batch_size=5000)
                batch = []
        Step.objects.bulk_create(batch, batch_size=5000)
        for k, slot in enumerate(slots):
            slot.current_trajectory = trajs[-len(slots) + k]
            if k == 5:
                slot.status, slot.last_error = (
                    "quarantined",
                    "EnvUnavailable: chromium exited (3 times)",
                )
            slot.save()
        stats, history = [], []
        for t in tasks:
            s = skill[t.pk]
            stats.append(TaskStat(run=run, task=t, attempts=n_traj // len(tasks),
                                  successes=int(s * n_traj / len(tasks)), success_rate=s,
                                  rollout_budget=8 if s < 0.6 else max(2, int(9 / s - 7)),
                                  step_cap=15 if s < 0.3 else 8, pool_size=2,
                                  last_success_at=now - timedelta(minutes=rnd.randint(1, 50))))  # fmt: skip
            for g in range(60):
                r = min(1.0, s * 0.5 + g / 120 + rnd.uniform(-0.1, 0.1))
                history.append(TaskStatHistory(
                    run=run, task=t, at=start + timedelta(minutes=5 * g), success_rate=max(0.0, r),
                    rollout_budget=8 if r < 0.6 else max(2, int(9 / max(r, 0.1) - 7)),
                    step_cap=max(4, 15 - g // 6), pool_size=2,
                ))  # fmt: skip
        TaskStat.objects.bulk_create(stats)
        TaskStatHistory.objects.bulk_create(history)
        PolicyVersion.objects.bulk_create(
            [PolicyVersion(run=run, version=v, checkpoint=f"ck/{v}") for v in range(51)]
        )
        TrainUpdate.objects.bulk_create([
            TrainUpdate(run=run, number=u, policy_version=u // 4,
                        created_at=start + timedelta(seconds=span * u / 200),
                        metrics={"loss": 1.0 / (1 + u / 40) + rnd.uniform(0, 0.05),
                                 "pg_loss": rnd.uniform(-0.1, 0.1), "kl": u / 4000,
                                 "bc_loss": 0.0, "mean_entropy": 1.2 - u / 400,
                                 "clip_fraction": rnd.uniform(0.05, 0.2), "is_weight_mean": 0.93,
                                 "kept_step_fraction": 0.8, "duration_s": rnd.uniform(40, 70),
                                 "staleness": {"0": rnd.randint(40, 80), "1": rnd.randint(10, 30),
                                               "2": rnd.randint(0, 10)}})
            for u in range(1, 201)
        ])  # fmt: skip
    return run.pk


def measure(*, run_id: int, repeat: int) -> list[tuple[str, str, float, int]]:
    from django.contrib.auth.models import User
    from django.test import Client

    from datamanager.models import Trajectory

    client = Client()
    client.force_login(User.objects.get(username="ada"))
    traj = Trajectory.objects.filter(run_id=run_id, status="succeeded").order_by("-pk").first()
    pages = [
        ("runs list", "/"),
        ("run page", f"/runs/{run_id}/"),
        ("chart JSON", f"/runs/{run_id}/charts.json"),
        ("env wall JSON", f"/runs/{run_id}/slots.json"),
        ("task board", f"/runs/{run_id}/tasks/"),
        ("trajectory list", "/trajectories/"),
        ("trajectory list, page 150", "/trajectories/?page=150"),
        ("trajectory list, run+status", f"/trajectories/?run={run_id}&status=succeeded"),
        ("trajectory list, task+reward", "/trajectories/?task=enter&reward=positive"),
        ("trajectory list, policy version", "/trajectories/?policy_version=25"),
        ("trajectory page (20 steps)", f"/trajectories/{traj.pk}/"),
    ]
    rows = []
    for label, url in pages:
        client.get(url)  # warm caches / imports
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            r = client.get(url)
            times.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, (url, r.status_code)
        rows.append((label, url, statistics.median(times), len(r.content)))
    return rows


def screenshots(*, run_id: int, out: Path) -> None:
    """Serve the bench database with daphne and save a PNG of each page."""
    from django.conf import settings

    from bench.capture import capture_pages
    from core.procutil import terminate_pid
    from dartboard.embedded_redis import EmbeddedRedis
    from datamanager.models import TaskStat, Trajectory

    out.mkdir(parents=True, exist_ok=True)
    traj = Trajectory.objects.filter(run_id=run_id, status="succeeded").order_by("-pk").first()
    stat = TaskStat.objects.filter(run_id=run_id).first()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with EmbeddedRedis(settings.REDIS_SOCKET):
        proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
             "dartboard.asgi:application"],
            cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(150):
                try:
                    urllib.request.urlopen(f"{base}/health/", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            capture_pages(
                base=base,
                user="ada",
                password="lovelace-pass-1",
                run_id=run_id,
                trajectory_id=traj.pk,
                stat_id=stat.pk,
                out=out,
            )
        finally:
            terminate_pid(proc.pid, timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=20, help="steps per trajectory")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--screenshots", type=Path, default=None, help="save page PNGs here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dartboard-bench-") as home:
        _setup(Path(home))
        t0 = time.perf_counter()
        run_id = fill(n_traj=args.trajectories, steps_per=args.steps)
        fill_s = time.perf_counter() - t0
        from datamanager.models import Step, Trajectory

        print(f"filled {Trajectory.objects.count():,} trajectories, {Step.objects.count():,} steps "
              f"in {fill_s:.1f} s (SQLite, {home})\n")  # fmt: skip
        from django.conf import settings

        from dartboard.embedded_redis import EmbeddedRedis

        # The stack's Redis is up, as in a running deployment: the run page reads the slots'
        # leases there (without it, every request waits out the Redis client's retries).
        with EmbeddedRedis(settings.REDIS_SOCKET):
            rows = measure(run_id=run_id, repeat=args.repeat)
        print(f"| page | URL | median of {args.repeat} (ms) | size (KiB) |")
        print("|---|---|---:|---:|")
        for label, url, ms, size in rows:
            print(f"| {label} | `{url}` | {ms:.1f} | {size / 1024:.0f} |")
        if args.screenshots:
            screenshots(run_id=run_id, out=args.screenshots.resolve())
            print(f"\nscreenshots in {args.screenshots}")


if __name__ == "__main__":
    main()
