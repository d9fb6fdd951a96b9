"""Screenshots of every dashboard page from a running Dartboard (for the README).

    .venv/bin/python bench/capture.py --url http://127.0.0.1:8000 --user admin \\
        --password ... --run 1 [--trajectory ID] [--out docs/screenshots]

Logs in with headless Debian chromium (Playwright, never a downloaded browser) and saves a
PNG of each page. `bench/pages.py --screenshots` uses the same function on its bench data.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


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
) -> list[Path]:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
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
    saved = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path="/usr/bin/chromium",
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking"],
        )  # fmt: skip
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{base}/accounts/login/")
        page.screenshot(path=out / "login.png")
        saved.append(out / "login.png")
        page.fill("input[name=username]", user)
        page.fill("input[name=password]", password)
        page.click("button[type=submit]")
        page.wait_for_load_state()
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
            page.screenshot(path=out / f"{name}.png", full_page=name != "run_form")
            saved.append(out / f"{name}.png")
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
    args = ap.parse_args()
    for path in capture_pages(
        base=args.url.rstrip("/"),
        user=args.user,
        password=args.password,
        run_id=args.run,
        trajectory_id=args.trajectory,
        stat_id=args.stat,
        out=args.out,
        eval_jobs=tuple(args.eval_jobs) if args.eval_jobs else None,
    ):
        print(path)


if __name__ == "__main__":
    main()
