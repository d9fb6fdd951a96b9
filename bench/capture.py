"""Screenshots of every dashboard page from a running Dartboard (for the README).

    .venv/bin/python bench/capture.py --url http://127.0.0.1:8000 --user admin \\
        --password ... --run 1 [--trajectory ID] [--out docs/screenshots]
    .venv/bin/python bench/capture.py ... --run 1 --review --group ID \\
        --episode A_JOB B_JOB TASK SEED   # only the review pages: group, episodes, queue, health

Logs in with headless Debian chromium (Playwright, never a downloaded browser) and saves a
PNG of each page. `bench/pages.py --screenshots` uses the same function on its bench data.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def _browser(pw):
    return pw.chromium.launch(
        executable_path="/usr/bin/chromium",
        args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--disable-background-networking"],
    )  # fmt: skip


def _log_in(page, *, base: str, user: str, password: str) -> None:
    page.goto(f"{base}/accounts/login/")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_load_state()


def capture_run_chart(*, base: str, user: str, password: str, run_id: int, out: Path) -> Path:
    """The run page's first chart, greedy success per version with its 95% interval, as the
    PNG `out`."""
    from playwright.sync_api import sync_playwright

    out.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        _log_in(page, base=base, user=user, password=password)
        page.goto(f"{base}/runs/{run_id}/")
        page.wait_for_selector("#charts[data-loaded]", timeout=60000)
        time.sleep(1.0)
        page.locator("#chart-versions").screenshot(path=out)
        browser.close()
    return out


def capture_pages(
    *,
    base: str,
    user: str,
    password: str,
    run_id: int,
    trajectory_id: int | None,
    stat_id: int | None,
    out: Path,
    eval_jobs: tuple[int, int] | None = None,
    review_only: bool = False,
    group_id: int | None = None,
    episode: tuple[int, int, str, int] | None = None,
) -> list[Path]:
    """Long because it visits the pages one after another."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    review = [("label_queue", f"/runs/{run_id}/labels/", "#label-form, #queue-empty")]
    if group_id is not None:
        review.append(("group", f"/groups/{group_id}/", None))
    if episode is not None:
        a, b, task, seed = episode
        review.append(
            ("episode_compare",
             f"/evaluations/compare/episodes/?a={a}&b={b}&task={task}&seed={seed}", None)
        )  # fmt: skip
    shots = [
        ("runs", "/", None),
        ("run_form", "/runs/new/", None),
        ("run", f"/runs/{run_id}/", "#charts[data-loaded]"),
        ("task_board", f"/runs/{run_id}/tasks/", None),
        ("trajectories", f"/trajectories/?run={run_id}", None),
        ("upload", "/trajectories/upload/", None),
        ("evaluations", "/evaluations/", None),
        ("evaluation_matrix", "/evaluations/matrix/", None),
    ]
    if eval_jobs:
        first, second = eval_jobs
        shots.append(("evaluation", f"/evaluations/{first}/", None))
        shots.append(("evaluation_compare", f"/evaluations/compare/?a={first}&b={second}", None))
    if stat_id is not None:
        shots.append(("task_override", f"/runs/{run_id}/tasks/{stat_id}/override/", None))
    if trajectory_id is not None:
        shots.append(("trajectory", f"/trajectories/{trajectory_id}/#step-1", None))
    shots = review if review_only else shots + review
    saved = []
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{base}/accounts/login/")
        page.screenshot(path=out / "login.png")
        saved.append(out / "login.png")
        _log_in(page, base=base, user=user, password=password)
        for name, url, wait in shots:
            page.goto(base + url)
            if wait:
                page.wait_for_selector(wait, timeout=30000)
                time.sleep(1.0)
            # Screenshots are <img> loads: wait for them, or the inspector shows a black frame.
            if name == "trajectory":
                # The inspector's screenshots are plain <img> loads: wait for the one shown.
                page.wait_for_function(
                    "Array.from(document.querySelectorAll('#steps .step:not([hidden]) img'))"
                    ".every((i) => i.complete && i.naturalWidth > 0)"
                )
            if name in ("group", "episode_compare", "label_queue"):
                page.wait_for_function(
                    "Array.from(document.querySelectorAll('.frame img'))"
                    ".every((i) => i.complete && i.naturalWidth > 0)"
                )
            page.screenshot(path=out / f"{name}.png", full_page=name != "run_form")
            saved.append(out / f"{name}.png")
        # The run page's health panel: the host map and every chart below it.
        page.goto(f"{base}/runs/{run_id}/")
        page.wait_for_selector("#charts[data-loaded]", timeout=30000)
        time.sleep(1.0)
        top = page.locator("#hostmap, #charts").first.bounding_box()
        bottom = page.locator("#charts").bounding_box()
        if top and bottom:
            page.set_viewport_size(
                {"width": 1400, "height": int(bottom["y"] + bottom["height"]) + 20}
            )
            page.screenshot(
                path=out / "health.png",
                clip={"x": 0, "y": top["y"] - 40, "width": 1400,
                      "height": bottom["y"] + bottom["height"] - top["y"] + 50},
            )  # fmt: skip
            saved.append(out / "health.png")
        browser.close()
    return saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--user", default="admin")
    ap.add_argument("--password", required=True)
    ap.add_argument("--run", type=int, required=True)
    ap.add_argument("--trajectory", type=int, default=None)
    ap.add_argument("--stat", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    ap.add_argument("--eval-jobs", type=int, nargs=2, default=None, help="two EvalJob ids")
    ap.add_argument("--review", action="store_true", help="only the review pages")
    ap.add_argument("--group", type=int, default=None, help="a TaskGroup id")
    ap.add_argument("--episode", nargs=4, default=None, metavar=("A", "B", "TASK", "SEED"))
    args = ap.parse_args()
    episode = None
    if args.episode:
        a, b, task, seed = args.episode
        episode = (int(a), int(b), task, int(seed))
    for path in capture_pages(
        base=args.url.rstrip("/"),
        user=args.user,
        password=args.password,
        run_id=args.run,
        trajectory_id=args.trajectory,
        stat_id=args.stat,
        out=args.out,
        eval_jobs=tuple(args.eval_jobs) if args.eval_jobs else None,
        review_only=args.review,
        group_id=args.group,
        episode=episode,
    ):
        print(path)


if __name__ == "__main__":
    main()
