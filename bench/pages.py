"""Dashboard page load times on a large run: 10,000 trajectories and 200,000 steps.

Run: `.venv/bin/python bench/pages.py [--trajectories 10000] [--steps 20] [--screenshots DIR]`

Fills a fresh SQLite database under a temporary DARTBOARD_HOME (bulk_create; screenshots
are a dozen small real PNGs the steps share), then times each page with Django's test
Client, logged in (median of --repeat requests), and prints a markdown table. With
--screenshots it also serves the same data with the web server (`dartboard.serve`) and
saves a PNG of each page (headless chromium via Playwright) for the README.
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
from urllib.parse import urlencode

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
    """Create one big run (and a small one) with realistic shapes. Returns the run id.

    Long because it is the bench's data, made step by step."""
    from django.contrib.auth.models import User
    from django.core.files.base import ContentFile
    from django.core.files.storage import default_storage
    from django.db import transaction
    from django.utils import timezone

    from datamanager.config import RunConfig
    from datamanager.models import (
        EnvSlot,
        EvalJob,
        EvalStatus,
        FailureKind,
        FailureLabel,
        GroupStatus,
        PolicyVersion,
        Purpose,
        Run,
        RunStatus,
        SlotStatus,
        Step,
        Task,
        TaskGroup,
        TaskStat,
        TaskStatHistory,
        TrainUpdate,
        Trajectory,
        TrajectoryStatus,
    )  # fmt: skip
    from rollout.episode import EndReason

    _without_auto_now([(Trajectory, "started_at"), (Step, "created_at"),
                       (TaskStatHistory, "at"), (TrainUpdate, "created_at")])  # fmt: skip
    rnd = random.Random(seed)
    from datamanager.roles import role_group

    ada = User.objects.create_user("ada", password="lovelace-pass-1")
    # Every page needs a role (docs/security.md); the annotation queue is an operator's.
    ada.groups.add(role_group("operator"))
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
        run = Run.objects.create(name="miniwob-16 decoupled", config=cfg.to_dict(), status=RunStatus.RUNNING,
                                 started_at=start)  # fmt: skip
        Run.objects.create(name="miniwob-16 synchronous baseline", status=RunStatus.STOPPED,
                           config={**cfg.to_dict(), "mode": "synchronous"},
                           started_at=start, finished_at=now - timedelta(hours=2))  # fmt: skip
        slots = EnvSlot.objects.bulk_create(
            [
                EnvSlot(
                    name=f"worker-{1 + i // 4}:{4100 + i // 4}:{i % 4}",
                    key=f"miniwob:{i}",
                    host=f"worker-{1 + i // 4}",
                    backend="miniwob",
                    run=run,
                    status=SlotStatus.BUSY,
                )
                for i in range(8)
            ]
        )
        span = (now - start).total_seconds()
        updates = TrainUpdate.objects.bulk_create([
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
        # GRPO groups of 8 rollouts per task, in claim order.
        groups = TaskGroup.objects.bulk_create(
            [
                TaskGroup(run=run, task=t, index=g, budget=8, claimed=8, status=GroupStatus.TRAINED)
                for g in range(n_traj // len(tasks) // 8 + 1)
                for t in tasks
            ]
        )
        group_of = {(g.task_id, g.index): g for g in groups}
        trajs = []
        for i in range(n_traj):
            task = tasks[i % len(tasks)]
            t0 = start + timedelta(seconds=span * i / n_traj)
            ok = rnd.random() < min(0.95, skill[task.pk] + 0.4 * i / n_traj)
            running = i >= n_traj - len(slots)
            broken = not running and rnd.random() < 0.03  # an environment error
            status = (
                TrajectoryStatus.RUNNING if running
                else TrajectoryStatus.ERROR if broken
                else TrajectoryStatus.SUCCEEDED if ok
                else TrajectoryStatus.FAILED
            )  # fmt: skip
            length = steps_per
            trajs.append(Trajectory(
                run=run, task=task, env_slot=slots[i % len(slots)], started_at=t0,
                finished_at=None if running else t0 + timedelta(seconds=length * 1.7),
                status=status, reward=None if running or broken else float(ok), length=length,
                policy_versions=[i * 50 // n_traj], instruction=task.instruction, step_cap=15,
                in_pool=ok and i % 97 == 0, group=group_of[(task.pk, i // len(tasks) // 8)],
                error="EnvUnavailable: reset timed out after 30 s" if broken else "",
                details={} if running or broken else {
                    "end_reason": EndReason.FINISHED if ok
                                  else rnd.choice([EndReason.STEP_CAP, EndReason.FINISHED]),
                    "reset_ms": rnd.uniform(100, 400)},
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
                    trained_in_update=updates[min(199, ti * 200 // n_traj)],
                ))  # fmt: skip
            if len(batch) >= 20000:
                Step.objects.bulk_create(batch, batch_size=5000)
                batch = []
        Step.objects.bulk_create(batch, batch_size=5000)
        failed = [t for t in trajs if t.status in (TrajectoryStatus.FAILED, TrajectoryStatus.ERROR)]
        FailureLabel.objects.bulk_create(
            [
                FailureLabel(
                    trajectory=t,
                    run=run,
                    user=ada,
                    created_at=now,
                    label=rnd.choice(
                        [FailureKind.ENV_BUG, FailureKind.AGENT_MISTAKE, FailureKind.FINE]
                    ),
                )
                for t in failed[:300]
            ]
        )
        # Two checkpoints evaluated on every task, 4 seeds each, 10 steps an episode.
        for version in (10, 50):
            job = EvalJob.objects.create(
                name=f"v{version}", policy=f"run:{run.pk}:v{version}", run=run,
                policy_version=version, task_names=TASKS, k=4, status=EvalStatus.FINISHED,
                done=4 * len(tasks), total=4 * len(tasks),
            )  # fmt: skip
            episodes = Trajectory.objects.bulk_create(
                [
                    Trajectory(
                        task=t,
                        purpose=Purpose.EVAL,
                        eval_job=job,
                        seed=k,
                        status=TrajectoryStatus.FAILED,
                        reward=0.0,
                        length=10,
                        finished_at=now,
                        started_at=now,
                    )
                    for t in tasks
                    for k in range(4)
                ]
            )
            Step.objects.bulk_create(
                [
                    Step(
                        trajectory=e,
                        index=j,
                        screenshot=shots[j % len(shots)],
                        screen_width=160,
                        screen_height=210,
                        action=ACTIONS[(j + version * (j > 4)) % len(ACTIONS)],
                        created_at=now,
                    )
                    for e in episodes
                    for j in range(10)
                ]
            )
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
    return run.pk


def measure(*, run_id: int, repeat: int) -> list[tuple[str, str, float, int]]:
    from django.contrib.auth.models import User
    from django.test import Client

    from datamanager.models import EvalJob, TaskGroup, Trajectory, TrajectoryStatus

    client = Client()
    client.force_login(User.objects.get(username="ada"))
    traj = (
        Trajectory.objects.filter(run_id=run_id, status=TrajectoryStatus.SUCCEEDED)
        .order_by("-pk")
        .first()
    )
    group = TaskGroup.objects.filter(run_id=run_id).order_by("-pk")[20]
    a, b = EvalJob.objects.order_by("pk")[:2]
    window = Trajectory.objects.filter(run_id=run_id).order_by("finished_at")[5000].finished_at
    span = urlencode({"finished_from": window.isoformat(),
                      "finished_to": (window + timedelta(minutes=10)).isoformat()})  # fmt: skip
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
        ("group view (8 x 20 steps)", f"/groups/{group.pk}/"),
        (
            "checkpoint A vs B, one episode",
            f"/evaluations/compare/episodes/?a={a.pk}&b={b.pk}&task={TASKS[3]}&seed=2",
        ),
        ("evaluation compare (with seeds)", f"/evaluations/compare/?a={a.pk}&b={b.pk}"),
        ("annotation queue, failed", f"/runs/{run_id}/labels/"),
        ("annotation queue, sampled", f"/runs/{run_id}/labels/?queue=sampled"),
        ("labels export (JSONL)", f"/labels.jsonl?run={run_id}"),
        ("list, a chart point's window", f"/trajectories/?run={run_id}&{span}"),
        ("list, an update's rollouts", f"/trajectories/?run={run_id}&update=150"),
        ("list, reward bin", f"/trajectories/?run={run_id}&reward_min=1&reward_max=1.5"),
        ("list, end reason + env error", f"/trajectories/?run={run_id}&end=error&env_error=yes"),
        ("list, entropy range", f"/trajectories/?run={run_id}&entropy_min=1.4&entropy_max=1.5"),
        (
            "list, IS-weight range",
            f"/trajectories/?run={run_id}&is_weight_min=0&is_weight_max=0.71",
        ),
        ("list, label", f"/trajectories/?run={run_id}&label=env_bug"),
    ]
    rows = []
    for label, url in pages:
        client.get(url)  # warm caches / imports
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            r = client.get(url)
            body = b"".join(r.streaming_content) if r.streaming else r.content
            times.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, (url, r.status_code)
        size = len(body)
        rows.append((label, url, statistics.median(times), size))
    return rows


def screenshots(*, run_id: int, out: Path) -> None:
    """Serve the bench database with the web server and save a PNG of each page."""
    from django.conf import settings

    from bench.capture import capture_pages
    from core.procutil import terminate_pid
    from datamanager.models import TaskStat, Trajectory, TrajectoryStatus
    from hostagent.embedded_redis import EmbeddedRedis

    out.mkdir(parents=True, exist_ok=True)
    traj = (
        Trajectory.objects.filter(run_id=run_id, status=TrajectoryStatus.SUCCEEDED)
        .order_by("-pk")
        .first()
    )
    stat = TaskStat.objects.filter(run_id=run_id).first()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with EmbeddedRedis(settings.REDIS_SOCKET):
        proc = subprocess.Popen(
            [sys.executable, "-m", "dartboard.serve", "--host", "127.0.0.1", "--port", str(port)],
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

        from hostagent.embedded_redis import EmbeddedRedis

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
