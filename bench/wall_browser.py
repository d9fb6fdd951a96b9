"""A page of the env wall with hundreds of tiles in headless Chromium while its slots step.

    .venv/bin/python bench/wall_browser.py [--tiles 500] [--steps-per-s 100] [--seconds 30]

In a temporary DARTBOARD_HOME (SQLite, the embedded Redis): a running run with --tiles sim
slots, the web server (`python -m dartboard.serve`, as `make run` starts it), and Chromium
(/usr/bin/chromium through Playwright) logged in on the run page with every tile on one page
(`/runs/<id>/?per=<tiles>`). Then this process publishes step events for the run's slots,
round robin, at --steps-per-s through `datamanager.events.publish` (as a step record does),
each pointing at a screenshot file of its own (a new URL: the browser fetches each shown
screenshot, as it does live). Printed: the page's first contentful paint and
DOMContentLoaded; over the window, frames a second (requestAnimationFrame) and the longest
frame; events a second the page applied (`dartboard:event`) against those published.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking"]  # fmt: skip
SHOTS = 64  # distinct screenshot images; every step gets its own URL
TASKS = [f"sim/click-{k}" for k in range(8, 13)]

# Counts frames and event applications from the first script on; read back at the end.
PROBE = """
window.__probe = {frames: 0, longest: 0, events: 0, last: 0, start: 0};
document.addEventListener("dartboard:event", () => { window.__probe.events += 1; });
function __tick(t) {
  const p = window.__probe;
  if (p.last) p.longest = Math.max(p.longest, t - p.last);
  p.last = t; p.frames += 1;
  requestAnimationFrame(__tick);
}
requestAnimationFrame(__tick);
"""


def _setup(home: Path, tiles: int) -> int:
    """The database, a viewer, a running run with `tiles` busy sim slots; the run's id."""
    os.environ["DARTBOARD_HOME"] = str(home)
    os.environ["DJANGO_SETTINGS_MODULE"] = "dartboard.settings"
    for var in ("DATABASE_URL", "REDIS_URL", "DARTBOARD_ENV"):
        os.environ.pop(var, None)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.utils import timezone
    from PIL import Image

    from datamanager.config import RunConfig
    from datamanager.models import EnvSlot, Run, RunStatus
    from datamanager.roles import role_group
    from datamanager.services.episodes import taskstats_ensure
    from datamanager.services.runs import tasks_import
    from datamanager.task_import import parse_task_record
    from envmanager.sim_env import sim_task_records

    call_command("migrate", verbosity=0)
    tasks_import(records=[parse_task_record(r, "sim") for r in sim_task_records()])
    user = get_user_model().objects.create_user("ada", password="lovelace-pass-1")
    user.groups.add(role_group("viewer"))
    cfg = RunConfig.from_dict(
        {
            "policy": "oracle",
            "tasks": {"env_kinds": ["sim"], "names": TASKS},
            "env": {"miniwob_slots": 0, "sim_slots": tiles},
        }
    )
    run = Run.objects.create(
        name=f"wall of {tiles}", config=cfg.to_dict(), status=RunStatus.RUNNING,
        started_at=timezone.now(),
    )  # fmt: skip
    taskstats_ensure(run=run)  # the wall's task names
    EnvSlot.objects.bulk_create(
        [
            EnvSlot(name=f"w:{i:03d}", key=f"sim:{i}", host="w", backend="sim", run=run,
                    status="busy", last_heartbeat=timezone.now())
            for i in range(tiles)
        ]
    )  # fmt: skip
    shots = Path(settings.MEDIA_ROOT) / "bench"
    shots.mkdir(parents=True, exist_ok=True)
    for k in range(SHOTS):  # a 160x210 screen, as a MiniWoB or sim step stores
        image = Image.new("RGB", (160, 210), (k * 4 % 256, 120, 255 - k * 4 % 256))
        buf = io.BytesIO()
        image.save(buf, "PNG")
        (shots / f"shot-{k}.png").write_bytes(buf.getvalue())
    return run.pk


def _publish(
    run_id: int, slot_ids: list[int], task_ids: list[int], rate: float, until: float
) -> int:
    """Step events round robin over the slots at `rate` a second until `until`; how many.
    No database access: it runs beside Playwright's event loop."""
    from datamanager.events import publish

    sent, t0 = 0, time.time()
    while time.time() < until:
        slot = slot_ids[sent % len(slot_ids)]
        publish(
            run_id=run_id,
            kind="step",
            data={"slot": slot, "step": sent, "task": task_ids[sent % len(task_ids)],
                  "trajectory": None, "action": {"kind": "click", "x": 10, "y": 20},
                  "policy_version": 0, "parse_error": "",
                  "image": f"/media/bench/shot-{sent % SHOTS}.png?step={sent}"},
        )  # fmt: skip
        sent += 1
        time.sleep(max(0.0, t0 + sent / rate - time.time()))
    return sent


def _serve(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dartboard.serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health/", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the web server did not answer within 60 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=500)
    ap.add_argument("--steps-per-s", type=float, default=100.0)
    ap.add_argument("--seconds", type=float, default=30.0, help="window with events arriving")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dartboard-wall-") as home:
        run_id = _setup(Path(home), args.tiles)
        from django.conf import settings
        from playwright.sync_api import sync_playwright

        from core.procutil import terminate_pid
        from datamanager.models import EnvSlot, TaskStat
        from hostagent.embedded_redis import EmbeddedRedis

        slot_ids = list(EnvSlot.objects.filter(run_id=run_id).values_list("pk", flat=True))
        task_ids = list(TaskStat.objects.filter(run_id=run_id).values_list("task_id", flat=True))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        with EmbeddedRedis(settings.REDIS_SOCKET):
            web = _serve(port)
            try:
                with sync_playwright() as pw:
                    browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)  # fmt: skip
                    page = browser.new_page(viewport={"width": 1600, "height": 1000})
                    page.goto(f"{base}/accounts/login/")
                    page.fill("input[name=username]", "ada")
                    page.fill("input[name=password]", "lovelace-pass-1")
                    page.click("button[type=submit]")
                    page.wait_for_load_state()
                    page.add_init_script(PROBE)
                    page.goto(f"{base}/runs/{run_id}/?per={args.tiles}")
                    page.wait_for_selector("html[data-live=open]", state="attached", timeout=60000)
                    shown = page.locator(".tile[data-slot]").count()
                    loaded = page.evaluate(
                        "(() => { const n = performance.getEntriesByType('navigation')[0];"
                        " const p = performance.getEntriesByName('first-contentful-paint')[0];"
                        " return {fcp: p ? p.startTime : null,"
                        " dcl: n.domContentLoadedEventEnd}; })()"
                    )
                    before = page.evaluate(
                        "(() => { window.__probe.longest = 0;"
                        " return {...window.__probe, now: performance.now()}; })()"
                    )
                    until = time.time() + args.seconds
                    sent = _publish(run_id, slot_ids, task_ids, args.steps_per_s, until)
                    time.sleep(1.0)  # the last flush of the socket
                    after = page.evaluate("({...window.__probe, now: performance.now()})")
                    browser.close()
            finally:
                terminate_pid(web.pid, timeout=10)
    secs = (after["now"] - before["now"]) / 1000
    print(f"tiles on the page: {shown}; first contentful paint {loaded['fcp']:.0f} ms, "
          f"DOMContentLoaded {loaded['dcl']:.0f} ms")  # fmt: skip
    print(f"window {secs:.1f} s: {(after['frames'] - before['frames']) / secs:.1f} frames/s, "
          f"longest frame {after['longest']:.0f} ms; events published {sent / args.seconds:.1f}/s, "
          f"applied by the page {(after['events'] - before['events']) / secs:.1f}/s")  # fmt: skip


if __name__ == "__main__":
    main()
