"""The dashboard in a real chromium against the web server (HTTP + WebSockets), with events
from the services an env worker calls: create and start a run, watch a tile update live,
inspect the trajectory with the arrow keys, promote it and override its reward."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth.hashers import PBKDF2PasswordHasher

from core.procutil import terminate_pid
from tests.conftest import png_bytes
from tests.helpers import free_port, needs
from tests.private_services import server_log, wait_answering

pytestmark = [pytest.mark.browser, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking"]  # fmt: skip


def in_thread(fn, *args, **kwargs):
    """Run Django ORM/Channels code outside Playwright's event loop (a fresh thread)."""
    box: dict = {}

    def target():
        from django.db import connection

        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc
        finally:
            connection.close()

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


@contextlib.contextmanager
def running_web(env: dict[str, str], *, timeout: float = 30) -> Iterator[str]:
    """The dashboard served by `dartboard.serve` (as `make run` starts it) with `env`; its URL
    (once its health page answers, within `timeout` seconds)."""
    with running_web_process(env, timeout=timeout) as (url, _):
        yield url


@contextlib.contextmanager
def running_web_process(
    env: dict[str, str], *, timeout: float = 30
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`running_web`'s URL and the server's process."""
    port = free_port()
    with server_log("web") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dartboard.serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_answering(f"{url}/health/", proc, what="web", log=log.name, timeout=timeout)
        yield url, proc
    finally:
        terminate_pid(proc.pid, timeout=10)


@pytest.fixture
def web(subprocess_env, tiny_policy_dir):
    # The lab keeps its checkpoints beside the tiny policy: a run may point there.
    roots = {"DARTBOARD_CHECKPOINT_ROOTS": str(tiny_policy_dir.parent)}
    with running_web({**subprocess_env, **roots}) as url:
        yield url


@pytest.fixture
@needs("browser")
def page(monkeypatch):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1300, "height": 900})
            pg.set_default_timeout(15000)
            yield pg
        finally:
            browser.close()


def record(trajectory_id: int, index: int, action: dict) -> None:
    from tests.datamanager.factories import step_record

    step_record(
        trajectory_id=trajectory_id, index=index, screenshot_png=png_bytes(color=(40 * index, 120, 200)),
        width=160, height=210, raw_output=f"Thought: go {index}\nAction: click(...)",
        thought=f"go {index}", action=action, parse_error="", prompt_tokens=10,
        response_tokens=5, rollout_logprobs=[-0.2, -0.1], mean_entropy=0.4, policy_version=0,
        env_ms=30.0, model_ms=80.0,
    )  # fmt: skip


def test_researcher_runs_watches_inspects_and_curates(web, researcher, page, tiny_policy_dir):
    from datamanager.models import EnvSlot, Run, Task, Trajectory
    from datamanager.roles import role_group
    from datamanager.services.episodes import task_claim, taskstats_ensure, trajectory_finish

    in_thread(Task.objects.create, name="click-button", env_kind="miniwob", instruction="Click OK")
    # The server runs the project's settings (PBKDF2), the suite MD5: store a PBKDF2 hash.
    hashed = PBKDF2PasswordHasher().encode("lovelace-pass-1", "saltsalt", iterations=1000)
    in_thread(type(researcher).objects.filter(pk=researcher.pk).update, password=hashed)
    # A run on a checkpoint path is an admin's to create: Ada is the lab's admin here.
    in_thread(lambda: researcher.groups.add(role_group("admin")))

    page.goto(f"{web}/accounts/login/")
    page.fill("input[name=username]", "ada")
    page.fill("input[name=password]", "lovelace-pass-1")
    page.click("button[type=submit]")
    page.goto(f"{web}/runs/new/")
    page.fill("input[name=name]", "browser run")
    page.fill("input[name=policy]", str(tiny_policy_dir))
    page.fill("input[name='trainer.lr']", "-3")
    page.click("text=Create run")
    page.wait_for_selector("[data-field='trainer.lr'] .errorlist >> text=must be > 0, got -3.0")
    page.fill("input[name='trainer.lr']", "0.00002")
    page.click("text=Create run")
    page.wait_for_selector("h1 >> text=browser run")
    page.click("button[value=start]")
    page.wait_for_selector("#run-status.running")
    page.wait_for_selector("#ws-state >> text=live")

    run = in_thread(Run.objects.get, name="browser run")
    assert run.config["trainer"]["lr"] == 2e-5
    in_thread(taskstats_ensure, run=run)
    slot = in_thread(
        EnvSlot.objects.create, name="h:1:0", host="h", backend="miniwob", run=run, status="busy"
    )
    claim = in_thread(task_claim, run_id=run.pk, slot_id=slot.pk, env_kinds=("miniwob",))
    in_thread(record, claim.trajectory_id, 0, {"type": "click", "x": 30, "y": 40})
    tile = page.locator(f".tile[data-slot='{slot.pk}']")
    tile.locator(".shot img").wait_for()
    assert f"/traj-{claim.trajectory_id}/000" in tile.locator("img").get_attribute("src")
    in_thread(record, claim.trajectory_id, 1, {"type": "type", "text": "hello"})
    page.wait_for_selector(f".tile[data-slot='{slot.pk}'] .step >> text=1")
    assert f"/traj-{claim.trajectory_id}/001" in tile.locator("img").get_attribute("src")
    page.wait_for_selector(f".tile[data-slot='{slot.pk}'] .task >> text=click-button")

    tile.click()
    page.wait_for_selector(f"h1 >> text=Trajectory #{claim.trajectory_id}")
    page.wait_for_selector("html[data-live=open]", state="attached")  # subscribed to events
    in_thread(trajectory_finish, trajectory_id=claim.trajectory_id, status="succeeded", reward=1.0)
    page.wait_for_selector("#traj-status.succeeded")  # the page refreshed itself live

    visible = "#steps .step:not([hidden])"
    assert page.locator(visible).get_attribute("data-index") == "1"
    page.keyboard.press("ArrowLeft")
    assert page.locator(visible).get_attribute("data-index") == "0"
    assert page.locator(f"{visible} svg.overlay circle").count() >= 1
    page.keyboard.press("ArrowRight")
    assert page.locator(visible).get_attribute("data-index") == "1"
    assert "type: 'hello'" in page.locator(f"{visible} svg.overlay text").text_content()

    page.click("#promote")
    page.wait_for_selector("#pool-badge")
    page.fill("#reward-form input[name=reward]", "0.5")
    page.fill("#reward-form textarea[name=reason]", "only half of the form filled")
    page.click("#reward-form button")
    page.wait_for_selector("table.overrides >> text=only half of the form filled")
    traj = in_thread(Trajectory.objects.get, pk=claim.trajectory_id)
    assert (traj.in_pool, traj.reward, traj.reward_source) == (True, 0.5, "human")


def _log_in_as_ada(page, url: str, researcher) -> None:
    # The server runs the project's settings (PBKDF2), the suite MD5: store a PBKDF2 hash.
    hashed = PBKDF2PasswordHasher().encode("lovelace-pass-1", "saltsalt", iterations=1000)
    in_thread(type(researcher).objects.filter(pk=researcher.pk).update, password=hashed)
    page.goto(f"{url}/accounts/login/")
    page.fill("input[name=username]", "ada")
    page.fill("input[name=password]", "lovelace-pass-1")
    page.click("button[type=submit]")


def test_the_run_page_says_while_redis_is_down(subprocess_env, researcher, page, tmp_path):
    """The banner and the health line follow a Redis outage live (the page polls over
    HTTP: its WebSocket feed rides on the Redis that is down)."""
    from hostagent.embedded_redis import EmbeddedRedis
    from tests.datamanager.factories import make_running_run, make_tasks

    redis = EmbeddedRedis(tmp_path / "r" / "redis.sock")
    redis.start()
    try:
        with running_web({**subprocess_env, "REDIS_URL": redis.url}) as url:
            in_thread(make_tasks, 1)
            run = in_thread(make_running_run)
            _log_in_as_ada(page, url, researcher)
            page.goto(f"{url}/runs/{run.pk}/")
            page.wait_for_selector("#health-line .svc.up[data-service=redis]")
            assert "Redis" not in page.text_content("#outage-banner")  # (no router runs here)

            redis.stop()
            page.wait_for_selector("#outage-banner >> text=Redis down since")
            page.wait_for_selector("#health-line .svc.down[data-service=redis]")
            title = page.get_attribute("#health-line [data-service=redis]", "title")
            assert title and "connecting to" in title  # the last error, on hover

            redis.start()
            page.wait_for_selector("#health-line .svc.up[data-service=redis]")
            page.wait_for_function(
                "!document.getElementById('outage-banner').textContent.includes('Redis')"
            )
    finally:
        redis.stop()
