"""The main job behind `make run`: a real DART run on MiniWoB++ click tasks with the tiny
policy on CPU (`make run-desktop`: the X desktop tasks instead), prepared idempotently so a
restart resumes the same run.

Steps: build the untrained tiny policy if missing; import the built-in tasks; pre-collect
oracle demonstrations into the experience pool; create the preset's run (DART RL with every
curation feature on; the desktop preset starts from the desktop policy) or find it.
"""

from __future__ import annotations

import copy
from typing import Any

from django.core.management import call_command

from datamanager.config import RunConfig
from datamanager.models import EnvKind, Run, Split, Task
from datamanager.services.runs import run_create

# The presets `run_dartboard --preset` starts: MiniWoB++ (`make run`), the same served by
# vLLM (`make run-vllm`) and the X desktops (`make run-desktop`), each its own run, found
# again by name on a restart.
MAIN_RUN_NAMES = {
    "miniwob": "main (make run)",
    "vllm": "main on vLLM (make run-vllm)",
    "desktop": "desktop (make run-desktop)",
}
MAIN_RUN_NAME = MAIN_RUN_NAMES["miniwob"]
# MiniWoB++ click tasks where RL has room: the shipped policy solves some of their instances
# greedily and not others. Left out: tasks it already solves (click-test, focus-text) or
# nearly (click-color), and click-link, which asks it to read a word among words and which
# RL barely moved: their rollouts would take the trainer's time and add only noise to the
# chart (docs/benchmarks.md, *The main job, three seeds*, has the figures).
MAIN_MINIWOB_TASKS = ["click-test-2", "click-button", "click-dialog"]

# Shared by both presets. CPU-sized: 3 screenshots of context (DART uses 5) keep a 2-core
# machine's trainer update under a minute; every curation feature is on. The tiny policy was
# pretrained on first steps only, so one unparsable output ends an episode. lr 5e-5: 1e-4
# learned no faster (docs/benchmarks.md, *What makes RL carry over to held-out seeds*).
_ROLLOUT = {"max_new_tokens": 48, "inference_workers": 1, "max_images": 3, "max_parse_errors": 1}
# A version's weights (23 MB for the tiny policy) are kept for the newest 10, every 25th, the
# best and any under evaluation: about 45 versions after 8 hours instead of ~800.
_TRAINER = {"lr": 5e-5, "micro_batch": 4, "kl_coef": 0.1, "versions_kept": 10,
            "versions_keep_every": 25}  # fmt: skip
# The desktop preset: one screenshot of context, the current screen (the desktop policy was
# pretrained so: its earlier actions come as text), which keeps an 800x600 step's prompt
# at ~800 tokens on a 2-core machine.
DESKTOP_ROLLOUT = {**_ROLLOUT, "max_images": 1}
# Behaviour-cloning updates on the oracle's demonstrations before RL (0: none). Measured with
# and without in docs/benchmarks.md, *The desktop preset*.
DESKTOP_WARM_START = 0


def main_run_config(preset: str = "miniwob") -> RunConfig:
    """The run a preset starts (see docs/benchmarks.md, *The main job observed*, for what it
    shows), parsed and checked here, once."""
    if preset not in MAIN_RUN_NAMES:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(MAIN_RUN_NAMES)}")
    return RunConfig.from_dict(_preset_settings(preset))


def _preset_settings(preset: str) -> dict[str, Any]:
    """A preset's settings as the run's JSON gives them. Long: each preset's configuration
    is one literal, read whole."""
    if preset == "desktop":
        desktop = list(
            Task.objects.filter(env_kind=EnvKind.DESKTOP, split=Split.TRAIN).values_list(
                "name", flat=True
            )
        )
        # The desktop policy (policies/tiny-desktop, `make policy-desktop`): the shipped one
        # further pretrained on synthetic desktops (bench/desktop.py measures it before RL).
        # The desktop tasks are fixed, one instance each (as OSWorld's): an evaluation plays
        # each once, greedily, on one of the two slots.
        return {
            "policy": "shipped-desktop",
            "tasks": {
                "split": "train",
                "names": desktop,
                "env_kinds": ["desktop"],
                "instances": 1,
            },
            "env": {"miniwob_slots": 0, "desktop_slots": 2},
            "rollout": DESKTOP_ROLLOUT,
            "trainer": {
                **_TRAINER,
                "warm_start_bc_updates": DESKTOP_WARM_START,
                "min_groups": 2,
                "max_steps_per_update": 64,
            },
            "evaluation": {
                "every_n_versions": 1,
                "slot_share": 1 / 2,
                "eval_split": False,
                "train_instances": True,
            },
        }
    if preset == "vllm":
        # The main job as a GPU user runs a 7B model: vLLM (its CPU build here) serves the
        # rollouts and the trainer publishes LoRA adapters, each loaded into vLLM beside the
        # serving one (no pause). A LoRA update moves less than a full one: a higher lr.
        main = copy.deepcopy(_preset_settings("miniwob"))
        main["rollout"]["backend"] = "vllm"
        main["trainer"].update({"lora_rank": 16, "lora_alpha": 32, "lr": 5e-4})
        return main
    return {
        "policy": "shipped",
        # Fixed training instances, as DART trains on OSWorld's fixed tasks: RL learns
        # them within a 30-minute run (docs/benchmarks.md).
        "tasks": {
            "split": "train",
            "names": [f"miniwob/{n}" for n in MAIN_MINIWOB_TASKS],
            "env_kinds": ["miniwob"],
            "instances": 10,
        },
        "env": {"miniwob_slots": 3},
        "rollout": _ROLLOUT,
        # No warm start: the shipped policy was pretrained on these screens, and the
        # first RL version must come within minutes (6 warm-start updates took 16 minutes
        # in the first main job). Two ready groups and 48 steps make an update.
        "trainer": {**_TRAINER, "min_groups": 2, "max_steps_per_update": 48},
        # Three slots collect faster than one CPU trainer trains: no new group is opened
        # while two updates' steps wait (docs/architecture.md, *Backpressure*), instead
        # of collecting steps that would go stale.
        "curation": {"backpressure": 2},
        # Greedy success per version on the training instances and on held-out seeds
        # (the run page's first chart): the starting policy, then the newest version
        # whenever the evaluation slot (one of three) is free; not the 23 tasks of the
        # eval split, whose episodes would take the slots' time. 10 held-out seeds per
        # task: 30 episodes, as many as the training instances.
        "evaluation": {
            "every_n_versions": 1,
            "slot_share": 1 / 3,
            "eval_split": False,
            "train_instances": True,
            "heldout_k": 10,
        },
    }


# Oracle demonstrations per task pre-collected into the experience pool (seeds 10000+).
DEMOS_PER_TASK = 3


def prepare_main_run(
    *, write, preset: str = "miniwob", demos_per_task: int = DEMOS_PER_TASK
) -> Run:
    """Everything before the workers start. `write` prints progress lines."""
    write("==> tiny policy")
    call_command("make_tiny_policy")
    write("==> built-in tasks")
    call_command("import_builtin_tasks")
    name = MAIN_RUN_NAMES[preset]
    run = Run.objects.filter(name=name).order_by("-pk").first()
    if run is None:
        run = run_create(name=name, config=main_run_config(preset))
        write(f"==> created run #{run.pk} {name!r}")
    else:
        write(f"==> resuming run #{run.pk} {name!r} ({run.status})")
    cfg = run.cfg
    write("==> oracle demonstrations for the experience pool")
    call_command(
        "collect_demos",
        per_task=demos_per_task,
        tasks=",".join(cfg.tasks.names),
        kinds=",".join(cfg.tasks.env_kinds),
        policy=cfg.policy,
    )
    return run
