"""Does RL lift success over the behaviour-cloning warm start, and what does each curation
feature contribute?

    .venv/bin/python bench/learning.py --minutes 30 --variants full,no_high_entropy,...

For each variant a run on a private stack (bench/stack.py) does the behaviour-cloning warm
start on oracle demonstrations (published as version 1), then DART RL for `--minutes`; then
version 1 and the last version are evaluated on held-out seeds of the same tasks through the
evaluation harness (greedy, fixed seeds). Prints success before/after RL per variant.

`--shared-warm-start` (for ablations) does the warm start once, in a run of its own, and
starts every variant's RL from that checkpoint (so the KL reference is the warm-started
policy): the variants differ only in their curation, the warm start is evaluated once, and
each variant saves the ~10 minutes of its own warm start. `--k 0` skips the held-out seeds.
Each variant's result is printed as soon as it is known and kept in
bench/results/learning.json.

`--instances N` trains on N fixed instances (seeds) per task, as DART trains on OSWorld's
fixed tasks, and also evaluates both versions on exactly those training instances: DART's
ablation reports pass@1 on its training tasks. The held-out seeds say whether what RL
learned carries over to screens it never saw.
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
from datamanager.curation import INSTANCE_SEED_BASE  # noqa: E402

VARIANTS = {
    "full": {},
    "no_dynamic_budget": {"dynamic_budget": False},
    "no_dynamic_length": {"dynamic_step_cap": False},
    "no_high_entropy": {"high_entropy": False},
    "no_truncated_is": {"truncated_is": False},
    "no_experience_pool": {"experience_pool": False},
}
# The shipped policy's unsaturated click tasks: it already solves click-test (100%) and
# focus-text (93%) greedily, so those two would only dilute what RL adds.
DEFAULT_TASKS = "click-test-2,click-button,click-link,click-dialog,click-color"


def _tasks(args) -> list[str]:
    return [f"miniwob/{t}" for t in args.tasks.split(",")]


def _config(args, *, curation: dict, policy: str, warm_start: int):
    from datamanager.config import RunConfig

    return RunConfig.from_dict({
        "policy": policy,
        "tasks": {"names": _tasks(args), "instances": args.instances},
        "env": {"miniwob_slots": args.slots},
        # A valid click is ~21 tokens. The tiny policy was pretrained on first steps only, so a
        # later step's output is mostly unparsable: one such output ends the episode instead
        # of three, so a lucky late click cannot reward the junk before it.
        "rollout": {"max_new_tokens": 32, "max_images": 3, "max_parse_errors": 1},
        "curation": curation,
        "trainer": {"warm_start_bc_updates": warm_start, "kl_coef": args.kl_coef,
                    "micro_batch": 4, "max_steps_per_update": args.max_steps,
                    "min_groups": args.min_groups, "lr": args.lr,
                    "loss_aggregation": args.aggregation},
    })  # fmt: skip


def _evaluate(label: str, policy: str, *, args, seed_base: int) -> dict:
    """Greedy success on the held-out seeds (unless --k 0) and, with --instances, on the
    training instances: {"" or "train_": (success rate, {task: success rate})}."""
    from datamanager.models import Task
    from datamanager.services.evaluations import eval_job_create
    from workers.evaluation import eval_job_run

    task_rows = list(Task.objects.filter(name__in=_tasks(args)))
    evals = [("", args.k, args.eval_seed)] if args.k else []
    if args.instances:  # the training instances: the seeds the run's groups cycled through
        evals.append(("train_", args.instances, INSTANCE_SEED_BASE + seed_base))
    out: dict[str, tuple[float, dict]] = {}
    for prefix, k, seed in evals:
        job = eval_job_create(
            name=f"{label} {prefix or 'held-out'}", policy=policy, tasks=task_rows, k=k, seed=seed
        )
        job = eval_job_run(job_id=job.pk)
        out[prefix] = (
            job.report["summary"]["success_rate"],
            {r["task"]: r["success_rate"] for r in job.report["tasks"]},
        )
    return out


def _warm_started(run, *, args) -> None:
    """Start `run` and wait for its warm start's version; the experience pool gets the oracle
    demonstrations first. Stops the bench if the warm start was skipped (an empty pool makes
    the trainer go straight to RL, which would make every figure after it meaningless)."""
    from django.core.management import call_command

    from datamanager.models import PolicyVersion, Run, TrainUpdate
    from datamanager.services.run_workers import run_apply

    call_command("collect_demos", per_task=3, tasks=",".join(_tasks(args)), kinds="miniwob")
    run_apply(run_id=run.pk, action="start")
    deadline = time.monotonic() + 3600
    while not PolicyVersion.objects.filter(run=run).exists():
        if time.monotonic() > deadline:
            raise SystemExit("the warm start did not finish within an hour")
        time.sleep(5)
    done = TrainUpdate.objects.filter(run=run, metrics__kind="warm_start").count()
    if done != args.warm_start:
        message = Run.objects.get(pk=run.pk).status_message
        raise SystemExit(
            f"run {run.pk}: {done} of {args.warm_start} warm-start updates ran ({message!r})"
        )


def _train(run, *, args, warm_start: bool) -> tuple[int, int]:
    """Start `run`, train for --minutes (after its own warm start, if it has one), stop;
    returns its first and last published versions."""
    from datamanager.models import PolicyVersion
    from datamanager.services.run_workers import run_apply
    from datamanager.services.runs import run_control

    minutes = args.minutes
    if warm_start:
        _warm_started(run, args=args)
    else:
        run_apply(run_id=run.pk, action="start")
    print(f"{run.name}: RL for {minutes} min", flush=True)
    time.sleep(minutes * 60)
    run_control(run_id=run.pk, action="stop")
    time.sleep(10)
    versions = PolicyVersion.objects.filter(run=run).values_list("version", flat=True)
    return (min(versions, default=0), max(versions, default=0))


def shared_warm_start(*, args) -> tuple[str, dict[str, tuple[float, dict]]]:
    """The warm start alone, once: its checkpoint (the variants' start) and its evaluation."""
    from datamanager.models import PolicyVersion
    from datamanager.services.runs import run_control, run_create

    cfg = _config(args, curation={}, policy=args.policy, warm_start=args.warm_start)
    run = run_create(name="learning warm start", config=cfg)
    _warm_started(run, args=args)
    run_control(run_id=run.pk, action="stop")
    version = PolicyVersion.objects.get(run=run)
    print(f"warm start done: {version.checkpoint}; evaluating it", flush=True)
    return version.checkpoint, _evaluate("warm start", f"run:{run.pk}:v{version.version}",
                                         args=args, seed_base=cfg.seed)  # fmt: skip


def run_variant(name: str, *, args, warm: tuple[str, dict[str, tuple[float, dict]]] | None) -> dict:
    from datamanager.services.runs import run_create

    if warm is None:  # its own warm start, evaluated as its version 1
        cfg = _config(args, curation=VARIANTS[name], policy=args.policy, warm_start=args.warm_start)
    else:
        cfg = _config(args, curation=VARIANTS[name], policy=warm[0], warm_start=0)
    run = run_create(name=f"learning {name}", config=cfg)
    first, last = _train(run, args=args, warm_start=warm is None)
    if warm is not None:
        first = 0  # its start checkpoint is the shared warm start
    out = {
        "variant": name,
        "versions": (first, last),
        "curve": online_curve(run),
        "effects": curation_effects(run),
    }
    before = warm[1] if warm is not None else _evaluate(
        f"{name} v{first}", f"run:{run.pk}:v{first}", args=args, seed_base=cfg.seed
    )  # fmt: skip
    after = _evaluate(f"{name} v{last}", f"run:{run.pk}:v{last}", args=args, seed_base=cfg.seed)
    for prefix in before:
        out[prefix + "warm_start"], out[prefix + "warm_start_tasks"] = before[prefix]
        out[prefix + "after_rl"], out[prefix + "after_rl_tasks"] = after[prefix]
    return out


def curation_effects(run) -> dict:
    """What each curation feature did in `run`, read from its data (so an ablation shows that
    the switched-off feature really was off): rollout budgets and step caps per task, pool
    demonstrations trained on, the share of steps the entropy filter kept, IS weights, stale
    steps left out."""
    from datamanager.models import Step, TaskStat, TrainUpdate

    rl = [u.metrics for u in TrainUpdate.objects.filter(run=run) if u.metrics.get("kind") == "rl"]
    stats = TaskStat.objects.filter(run=run).order_by("task__name")

    def mean(key: str) -> float | None:
        values = [m[key] for m in rl if m.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {
        "updates": len(rl),
        "budgets": [s.rollout_budget for s in stats],
        "step_caps": [s.step_cap for s in stats],
        "pool_steps_trained": sum(m.get("n_demo_steps", 0) for m in rl),
        # Of the online steps the entropy filter ranked (steps of groups with reward
        # variance), the share it kept; 100% when the filter is off.
        "entropy_kept": _share(
            Step.objects.filter(trajectory__run=run, entropy_kept__isnull=False),
            Step.objects.filter(trajectory__run=run, entropy_kept=True),
        ),
        "is_weight_mean": mean("is_weight_mean"),
        "is_weight_min": min(
            (m["is_weight_min"] for m in rl if "is_weight_min" in m), default=None
        ),
        "stale_steps_left_out": sum(m.get("stale_steps", 0) for m in rl),
    }


def _share(whole, part) -> float | None:
    n = whole.count()
    return part.count() / n if n else None


def online_curve(run, *, buckets: int = 5) -> list[tuple[str, int, float]]:
    """Success of the training rollouts by policy version, in `buckets` consecutive ranges:
    (versions, trajectories, success rate). Sampled, not greedy: the learning curve as the
    dashboard shows it."""
    from datamanager.models import (
        SCORED_STATUSES,
        Purpose,
        Trajectory,
        TrajectorySource,
        TrajectoryStatus,
    )

    rows = [
        (versions[0], status == TrajectoryStatus.SUCCEEDED)
        for versions, status in Trajectory.objects.filter(
            run=run,
            purpose=Purpose.TRAIN,
            source=TrajectorySource.ONLINE,
            status__in=SCORED_STATUSES,
        ).values_list("policy_versions", "status")
        if versions
    ]
    if not rows:
        return []
    top = max(v for v, _ in rows)
    size = max(1, -(-(top + 1) // buckets))
    curve = []
    for lo in range(0, top + 1, size):
        part = [ok for v, ok in rows if lo <= v < lo + size]
        if part:
            curve.append((f"v{lo}-v{min(top, lo + size - 1)}", len(part), sum(part) / len(part)))
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--variants", default="full")
    ap.add_argument("--tasks", default=DEFAULT_TASKS)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--policy", default="shipped")
    ap.add_argument("--warm-start", type=int, default=6)
    ap.add_argument(
        "--shared-warm-start",
        action="store_true",
        help="one warm start, every variant's RL starts from it (ablations)",
    )
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--kl-coef", type=float, default=0.1)
    ap.add_argument("--min-groups", type=int, default=4, help="ready task groups per update")
    ap.add_argument("--max-steps", type=int, default=64, help="most steps in one update")
    ap.add_argument("--aggregation", default="trajectory", choices=["trajectory", "token"])
    ap.add_argument("--k", type=int, default=20, help="held-out episodes per task (0: none)")
    ap.add_argument("--eval-seed", type=int, default=777, help="held-out seeds: 777000+i")
    ap.add_argument(
        "--instances", type=int, default=0,
        help="fixed training instances per task (0: a new seed for every group)",
    )  # fmt: skip
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; use {', '.join(VARIANTS)}")
    if not args.k and not args.instances:
        raise SystemExit("--k 0 needs --instances N: there would be nothing to evaluate on")
    results = []
    with PrivateStack(slots=args.slots, policy=args.policy) as stack:
        del stack  # entered for its processes; the runs talk to it through the database
        warm = shared_warm_start(args=args) if args.shared_warm_start else None
        for name in names:
            results.append(run_variant(name, args=args, warm=warm))
            print_rows(results[-1:], args, header=len(results) == 1)
            save(results, args)
    print(
        f"\nRL for {args.minutes} min after a {args.warm_start}-update warm start"
        + (" (shared)" if args.shared_warm_start else "")
        + (f"; held-out seeds {args.eval_seed}000+i, k={args.k}, greedy" if args.k else "")
    )
    print_rows(results, args, header=True)
    for r in results:
        print(
            f"\n{r['variant']} training rollouts (sampled) by version: "
            + ", ".join(f"{label} {rate:.0%} of {n}" for label, n, rate in r["curve"])
        )
        print(f"{r['variant']} curation in the data: {format_effects(r['effects'])}")
        for prefix in ("train_", ""):
            if prefix + "warm_start_tasks" not in r:
                continue
            before, after = r[prefix + "warm_start_tasks"], r[prefix + "after_rl_tasks"]
            print(
                f"{r['variant']} per task ({prefix.rstrip('_') or 'held-out'}): "
                + ", ".join(
                    f"{t.removeprefix('miniwob/')} {before[t]:.0%}->{after.get(t, 0):.0%}"
                    for t in sorted(before)
                )
            )


def format_effects(e: dict) -> str:
    def num(v, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    return (
        f"{e['updates']} RL updates; budgets {e['budgets']}; step caps {e['step_caps']}; "
        f"pool steps trained {e['pool_steps_trained']}; entropy filter kept "
        f"{num(e['entropy_kept'], '.0%')} of ranked steps; IS weight mean {num(e['is_weight_mean'], '.3f')}"
        f" (min {num(e['is_weight_min'], '.3f')}); stale steps left out "
        f"{e['stale_steps_left_out']}"
    )


def print_rows(results: list[dict], args, *, header: bool) -> None:
    if header:
        print("| variant | episodes | versions | after warm start | after RL | change (points) |")
        print("|---|---|---|---|---|---|")
    for r in results:
        for prefix, what in (("train_", f"training instances ({args.instances}/task)"),
                             ("", f"held-out seeds ({args.k}/task)")):  # fmt: skip
            if prefix + "warm_start" not in r:
                continue
            before, after = r[prefix + "warm_start"], r[prefix + "after_rl"]
            print(
                f"| {r['variant']} | {what} | v{r['versions'][0]} -> v{r['versions'][1]} | "
                f"{before:.1%} | {after:.1%} | {100 * (after - before):+.1f} |",
                flush=True,
            )


def save(results: list[dict], args) -> None:
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
