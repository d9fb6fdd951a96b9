"""`make run`'s main job, measured: its exact configuration on a private stack for 30 minutes.

    .venv/bin/python bench/mainjob.py [--minutes 30] [--every 5] [--preset miniwob]

Starts a private stack (bench/stack.py: a temporary SQLite home, the embedded Redis, the
preset's env workers, the trainer, one inference worker behind the router), prepares the
main run as `make run` does (`hostagent.main_job`: tasks, oracle demonstrations, the run) and
starts it. Every `--every` minutes it prints one row: policy versions, RL updates and their
mean time, sampled success of the rollouts finished in that window, and the latest finished
greedy evaluation (the run's own scheduled ones) on the training instances and on held-out
seeds, with the 95% interval. At the end it stops the run and evaluates the last version on
both (unless its scheduled evaluation exists), so the final row compares it with version 0.
Writes bench/results/mainjob.json (mainjob-PRESET.json for another preset, -seedN with
--seed, or --out; `--preset vllm` is `make run-vllm`'s: vLLM serving, LoRA versions).

`--screenshot PATH` also serves the dashboard of the private stack (its URL and a login are
printed, to watch the run live) and, at the end, saves the run page's success chart as PATH
before the run stops (the README's picture).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.stack import PrivateStack  # noqa: E402


def _greedy(run, scope: str, version: int | None = None, k: int | None = None) -> dict | None:
    """The latest finished scheduled evaluation of `scope` (or of `version`, with `k`
    episodes per task): its version, successes, episodes and 95% interval."""
    from django.db.models import Count, Q

    from datamanager.eval_metrics import wilson_interval
    from datamanager.models import SCORED_STATUSES, EvalJob, EvalStatus, TrajectoryStatus

    jobs = EvalJob.objects.filter(run=run, scope=scope, status=EvalStatus.FINISHED)
    if version is not None:
        jobs = jobs.filter(policy_version=version)
    if k is not None:
        jobs = jobs.filter(k=k)
    job = (
        jobs.annotate(
            ok=Count("trajectories", filter=Q(trajectories__status=TrajectoryStatus.SUCCEEDED)),
            scored=Count("trajectories", filter=Q(trajectories__status__in=SCORED_STATUSES)),
        )
        .order_by("-policy_version", "-pk")
        .first()
    )
    if job is None or not job.scored:
        return None
    low, high = wilson_interval(job.ok, job.scored)
    per_task = (
        job.trajectories.filter(status__in=SCORED_STATUSES)
        .values("task__name")
        .annotate(ok=Count("pk", filter=Q(status=TrajectoryStatus.SUCCEEDED)), n=Count("pk"))
        .order_by("task__name")
    )
    return {"version": job.policy_version, "ok": job.ok, "scored": job.scored,
            "rate": job.ok / job.scored, "low": low, "high": high,
            "tasks": {t["task__name"]: [t["ok"], t["n"]] for t in per_task}}  # fmt: skip


def snapshot(run, *, since, until, started) -> dict:
    """One row: what the run did between `since` and `until` (datetimes)."""
    from django.db.models import Avg, Count, FloatField, Q
    from django.db.models.fields.json import KT
    from django.db.models.functions import Cast

    from datamanager.models import (
        SCORED_STATUSES,
        PolicyVersion,
        TrainUpdate,
        Trajectory,
        TrajectorySource,
        TrajectoryStatus,
    )

    window = Trajectory.objects.filter(
        run=run, source=TrajectorySource.ONLINE, finished_at__gte=since, finished_at__lt=until
    ).aggregate(n=Count("pk", filter=Q(status__in=SCORED_STATUSES)),
                ok=Count("pk", filter=Q(status=TrajectoryStatus.SUCCEEDED)))  # fmt: skip
    rl = TrainUpdate.objects.filter(run=run, metrics__kind="rl")
    first_rl = rl.order_by("number").first()
    first_version = (
        PolicyVersion.objects.filter(run=run, created_at__gte=first_rl.created_at)
        .order_by("version")
        .first()
        if first_rl
        else None
    )
    ended = Trajectory.objects.filter(run=run, finished_at__gte=since, finished_at__lt=until)
    slot_s = {
        purpose: sum((t.finished_at - t.started_at).total_seconds()
                     for t in ended.filter(purpose=purpose).only("started_at", "finished_at"))
        for purpose in ("train", "eval")
    }  # fmt: skip
    train = _greedy(run, "train_instances")
    shown = (
        PolicyVersion.objects.filter(run=run, version=train["version"]).first() if train else None
    )
    newest = PolicyVersion.objects.filter(run=run).order_by("-version").first()
    return {
        "minute": round((until - started).total_seconds() / 60, 1),
        # Env-slot time of the window's episodes: the evaluation's share of it.
        "eval_share": slot_s["eval"] / (sum(slot_s.values()) or 1),
        # How old the newest version on the chart is: training's newest minus it, in minutes.
        "chart_lag_min": ((newest.created_at - shown.created_at).total_seconds() / 60)
        if shown and newest
        else None,
        "versions": PolicyVersion.objects.filter(run=run).count(),
        "rl_updates": rl.count(),
        "update_s": rl.filter(created_at__gte=since, created_at__lt=until).aggregate(
            s=Avg(Cast(KT("metrics__duration_s"), FloatField()))
        )["s"],
        # Rollout log-probs (the inference server's) against the trainer's on the same
        # tokens and weights, nats per token: the updates of this window.
        "logprob_gap": rl.filter(created_at__gte=since, created_at__lt=until).aggregate(
            g=Avg(Cast(KT("metrics__logprob_gap_mean"), FloatField()))
        )["g"],
        "sampled": (window["ok"] / window["n"]) if window["n"] else None,
        "sampled_n": window["n"],
        "train": train,
        "heldout": _greedy(run, "heldout"),
        "first_rl_version_s": (first_version.created_at - started).total_seconds()
        if first_version
        else None,
        "weights_kept": PolicyVersion.objects.filter(run=run, pruned_at__isnull=True).count(),
        "disk_mb": _disk(),
        "flow": _flow(run, until=until, started=started),
    }


def _flow(run, *, until, started) -> dict:
    """Where the online steps collected so far went (datamanager.selectors.flow), and the
    trained ones a minute since the run started."""
    from datamanager.selectors.flow import FATES, step_flow

    flow = step_flow(run=run, end=until)
    minutes = max((until - started).total_seconds() / 60, 1e-9)
    return {
        "collected": flow.collected,
        **{fate: getattr(flow, fate) for fate in FATES},
        "trained_share": flow.share("trained"),
        "chosen_share": flow.chosen_share,
        "stale_share": flow.share("stale"),
        "trained_per_min": flow.trained / minutes,
    }


def _share(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def _disk() -> dict:
    """MB on disk under the private home: in all (hard links once) and per part."""
    import os

    from django.conf import settings

    home = Path(settings.DARTBOARD_HOME)
    parts = {"checkpoints": Path(settings.CHECKPOINT_ROOT), "media": Path(settings.MEDIA_ROOT),
             "artifacts": home / "artifacts", "artifact_cache": Path(settings.DARTBOARD_ARTIFACT_CACHE)}  # fmt: skip
    out, seen = {}, set()
    for name, root in [("home", home), *parts.items()]:
        total = 0
        for dirpath, _, files in os.walk(root):
            for f in files:
                try:
                    st = os.stat(os.path.join(dirpath, f))
                except OSError:
                    continue
                if name == "home":
                    if st.st_ino in seen:
                        continue
                    seen.add(st.st_ino)
                total += st.st_size
        out[name] = round(total / 2**20, 1)
    return out


def _fmt(g: dict | None) -> str:
    if g is None:
        return "—"
    return f"v{g['version']} {g['rate']:.0%} [{g['low']:.0%}, {g['high']:.0%}] ({g['ok']}/{g['scored']})"


def print_row(row: dict, *, header: bool) -> None:
    if header:
        print("| minute | versions | RL updates | update (s) | log-prob gap | sampled success | "
              "evaluation's slot time | chart lag (min) | greedy, training instances | "
              "greedy, held-out seeds | weights kept | home on disk | collected steps | "
              "trained | stale | trained / min |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    update = f"{row['update_s']:.0f}" if row["update_s"] else "—"
    gap = f"{row['logprob_gap']:.4f}" if row.get("logprob_gap") is not None else "—"
    sampled = f"{row['sampled']:.0%} of {row['sampled_n']}" if row["sampled"] is not None else "—"
    lag = f"{row['chart_lag_min']:.1f}" if row.get("chart_lag_min") is not None else "—"
    flow = row.get("flow") or {}
    print(f"| {row['minute']:.0f} | {row['versions']} | {row['rl_updates']} | {update} | {gap} | "
          f"{sampled} | {row.get('eval_share', 0):.0%} | {lag} | {_fmt(row['train'])} | "
          f"{_fmt(row['heldout'])} | {row.get('weights_kept', '—')} | "
          f"{row.get('disk_mb', {}).get('home', 0):,.0f} MB | {flow.get('collected', 0)} | "
          f"{_share(flow.get('trained_share'))} | {_share(flow.get('stale_share'))} | "
          f"{flow.get('trained_per_min', 0):.1f} |", flush=True)  # fmt: skip


def final_evaluation(run, *, heldout_k: int | None = None) -> dict:
    """Version 0 and the last version on the training instances and held-out seeds: the
    scheduled job where it exists, else the same job run here, after the run stopped.
    `heldout_k`: that many held-out seeds per task instead of the run's `heldout_k`."""
    from datamanager.models import PolicyVersion
    from datamanager.services.evaluations import eval_job_create, scheduled_evaluations
    from workers.evaluation import eval_job_run

    cfg = run.cfg
    last = PolicyVersion.objects.filter(run=run).order_by("-version").first()
    out = {}
    for version in sorted({0, last.version if last else 0}):
        for scope, tasks, seed, k in scheduled_evaluations(cfg):
            if scope == "eval_split":
                continue
            if scope == "heldout" and heldout_k:
                k = heldout_k
            if _greedy(run, scope, version, k) is None:
                policy = f"run:{run.pk}:v{version}" if version else cfg.policy
                job = eval_job_create(name=f"bench v{version} {scope}", policy=policy,
                                      tasks=tasks, k=k, seed=seed, run_id=run.pk,
                                      policy_version=version, scope=scope)  # fmt: skip
                eval_job_run(job_id=job.pk)
            out[f"v{version} {scope}"] = _greedy(run, scope, version, k)
    return out


def seeds_table(paths: list[Path]) -> str:
    """The per-seed rows of `--seed N` runs (their JSON files) and the mean change with its
    spread: what the docs show for the main job."""
    import statistics

    rows, train_gain, heldout_gain = [], [], []
    for path in paths:
        data = json.loads(path.read_text())
        final, last = data["final"], data["rows"][-1]
        v0t, v0h = final["v0 train_instances"], final.get("v0 heldout")
        (lt,) = [
            v
            for k, v in final.items()
            if k.endswith("train_instances") and k != "v0 train_instances"
        ]
        # The desktop preset has no held-out side: its tasks are fixed, one instance each.
        lh = next(
            (v for k, v in final.items() if k.endswith("heldout") and k != "v0 heldout"), None
        )
        train_gain.append(100 * (lt["rate"] - v0t["rate"]))
        if v0h and lh:
            heldout_gain.append(100 * (lh["rate"] - v0h["rate"]))
        held_change = f"{100 * (lh['rate'] - v0h['rate']):+.0f}" if v0h and lh else "—"
        per_min = statistics.mean(r["sampled_n"] for r in data["rows"]) / data["args"]["every"]
        flow = last.get("flow") or {}
        rows.append(
            f"| {data['args']['seed']} | {last['versions']} | {_fmt(v0t)} | {_fmt(lt)} | "
            f"{train_gain[-1]:+.0f} | {_fmt(v0h)} | {_fmt(lh)} | {held_change} | "
            f"{per_min:.0f} | {statistics.mean(r['eval_share'] for r in data['rows']):.0%} | "
            f"{max(r['chart_lag_min'] or 0 for r in data['rows']):.1f} | "
            f"{last['first_rl_version_s']:.0f} | {_share(flow.get('trained_share'))} | "
            f"{_share(flow.get('chosen_share'))} | {_share(flow.get('stale_share'))} | "
            f"{flow.get('trained_per_min', 0):.1f} |"
        )

    def spread(xs: list[float]) -> str:
        if not xs:
            return "—"
        sd = f" (sd {statistics.stdev(xs):.1f})" if len(xs) > 1 else ""
        return f"{statistics.mean(xs):+.1f}{sd}"

    return "\n".join([
        "| seed | versions | training instances, v0 | last version | change | held-out, v0 | "
        "last version | change | training rollouts / min | evaluation's slot time | "
        "chart lag, max (min) | first RL version (s) | steps trained | trained or chosen "
        "out | stale | trained / min |",
        "|---:|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        f"\nMean change over {len(paths)} seed(s): training instances {spread(train_gain)} points, "
        f"held-out seeds {spread(heldout_gain)} points.",
    ])  # fmt: skip


def _with_settings(run, changes: list[str]):
    """The run with `changes` (KEY=JSON, dotted keys) applied and validated (an experiment
    against make run's configuration)."""
    from datamanager.config import RunConfig

    config = run.config
    for change in changes:
        key, _, raw = change.partition("=")
        *path, leaf = key.split(".")
        node = config
        for part in path:
            node = node[part]
        node[leaf] = json.loads(raw)
    run.config = RunConfig.from_dict(config).to_dict()
    run.save(update_fields=["config"])
    print(f"experiment: {', '.join(changes)}")
    return run


def _dashboard_login() -> tuple[str, str]:
    """An admin of the private stack's dashboard (a fresh password each bench)."""
    import secrets

    from django.contrib.auth import get_user_model

    password = secrets.token_urlsafe(12)
    get_user_model().objects.create_superuser("bench", password=password)
    return "bench", password


def main() -> None:
    """Long because it is the bench's steps in order."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--every", type=float, default=5, help="minutes between rows")
    ap.add_argument("--preset", default="miniwob", choices=["miniwob", "vllm", "desktop"])
    ap.add_argument("--slots", type=int, default=3, help="env workers: the preset's slots")
    ap.add_argument("--no-final", action="store_true", help="skip the final evaluations")
    ap.add_argument("--final-heldout-k", type=int, default=None, metavar="K",
                    help="held-out seeds per task in the final evaluations (default: the run's)")  # fmt: skip
    ap.add_argument("--demos", type=int, default=None, metavar="N",
                    help="oracle demos per task in the experience pool (default: make run's)")  # fmt: skip
    ap.add_argument("--screenshot", type=Path, default=None, metavar="PNG",
                    help="serve the dashboard too and save the run page's success chart here")  # fmt: skip
    ap.add_argument("--seed", type=int, default=None,
                    help="the run's seed (training instances, sampling); results go to "
                         "mainjob-seedN.json")  # fmt: skip
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="an experiment: change one setting of the preset's run, e.g. tasks.instances=50",
    )
    ap.add_argument("--out", type=Path, default=None, metavar="JSON",
                    help="write the results here (an experiment with --set: not over the "
                         "preset's own file)")  # fmt: skip
    ap.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="JSON",
                    help="print the per-seed table of finished --seed runs and exit")  # fmt: skip
    args = ap.parse_args()
    if args.summarize:
        print(seeds_table(args.summarize))
        return
    rows: list[dict] = []
    backend = "vllm" if args.preset == "vllm" else "transformers"
    web = args.screenshot is not None
    # The policy version 0's rollouts are served with: the preset's (main_run_config's).
    policy = "shipped-desktop" if args.preset == "desktop" else "shipped"
    with PrivateStack(slots=args.slots, policy=policy, web=web, backend=backend) as stack:
        from django.utils import timezone

        from datamanager.services.run_workers import run_apply
        from hostagent.main_job import main_run_config, prepare_main_run

        preset = main_run_config(args.preset)
        wanted = len(preset.env.slots())
        if wanted != args.slots:  # make run starts one env worker per slot
            raise SystemExit(f"the {args.preset} preset has {wanted} slots: use --slots {wanted}")
        if preset.policy != policy:
            raise SystemExit(
                f"the {args.preset} preset starts from {preset.policy!r}, not {policy!r}"
            )
        demos = {} if args.demos is None else {"demos_per_task": args.demos}
        run = prepare_main_run(write=print, preset=args.preset, **demos)
        changes = args.set + ([f"seed={args.seed}"] if args.seed is not None else [])
        if changes:
            run = _with_settings(run, changes)
        started = timezone.now()
        login = _dashboard_login() if args.screenshot else None
        run_apply(run_id=run.pk, action="start")
        print(f"run {run.pk} started; a row every {args.every:g} min for {args.minutes:g} min\n")
        if login:
            print(
                f"dashboard: {stack.web_url}/runs/{run.pk}/ (user {login[0]}, password {login[1]})\n"
            )
        since = started
        deadline = time.monotonic() + args.minutes * 60
        while time.monotonic() < deadline:
            time.sleep(min(args.every * 60, max(0.0, deadline - time.monotonic())))
            now = timezone.now()
            rows.append(snapshot(run, since=since, until=now, started=started))
            print_row(rows[-1], header=len(rows) == 1)
            since = now
        if args.screenshot:
            from bench.capture import capture_run_chart

            user, password = login
            try:  # the measurements matter more than the picture
                saved = capture_run_chart(base=stack.web_url, user=user, password=password,
                                          run_id=run.pk, out=args.screenshot.resolve())  # fmt: skip
                print(f"the run page's success chart: {saved}")
            except Exception as exc:
                print(f"the screenshot failed ({type(exc).__name__}: {exc}); see {stack.home}/logs")
        from datamanager.services.runs import run_control

        run_control(run_id=run.pk, action="stop")
        time.sleep(10)
        final = {} if args.no_final else final_evaluation(run, heldout_k=args.final_heldout_k)
        print("\nstopped; final greedy evaluations (version 0 and the last version):")
        for label, g in final.items():
            print(f"  {label}: {_fmt(g)}")
            if g:
                print(
                    "    "
                    + ", ".join(f"{t.split('/')[-1]} {ok}/{n}" for t, (ok, n) in g["tasks"].items())
                )
        first = rows[-1]["first_rl_version_s"] if rows else None
        print(f"first RL version {first:.0f} s after the run started" if first else
              "no RL version was published")  # fmt: skip
    name = "mainjob.json" if args.preset == "miniwob" else f"mainjob-{args.preset}.json"
    if args.seed is not None:
        name = name.replace(".json", f"-seed{args.seed}.json")
    out = args.out or ROOT / "bench" / "results" / name
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "final": final}, indent=2,
                              default=str))  # fmt: skip
    print(f"\nwritten {out}")


if __name__ == "__main__":
    main()
