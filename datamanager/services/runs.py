"""Writes to the data manager's tables. Keyword-only functions named `<entity>_<action>`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from core.artifacts import is_ref
from datamanager.config import ConfigError, ConfigInvalid, RunConfig
from datamanager.models import Run, RunAction, RunStatus, Task
from datamanager.policies import NAMED_POLICIES, ORACLE_POLICY, policy_path
from datamanager.roles import CAN_ADMINISTER
from datamanager.selectors.runs import gpu_hosts, largest_gpu_gib, processes_per_run
from datamanager.selectors.tasks import osworld_placements, task_list
from datamanager.task_import import TaskRecord, osworld_task_name
from envmanager.osworld_file_cache import FileCache
from rollout.limits import SHARED
from training.memory_plan import DoesNotFit, run_trainer_request, trainer_layout, vllm_fits

# A run's status after which nothing more happens to it on its own.
ENDED = (RunStatus.STOPPED, RunStatus.FINISHED, RunStatus.FAILED)


class InvalidTransition(ValueError):
    """A run control action is not allowed in the run's current status."""


class NotYourRun(PermissionError):
    """A user who is not an admin acted on a run another user owns."""


def run_config_validate(*, data: Any, user: User | None) -> RunConfig:
    """A run's settings, checked as every way in checks them (the run form, the API, a sweep,
    `manage.py start_run`): raises ConfigInvalid with every problem at once. First the
    config's own (`RunConfig.from_dict`), then the rules around it: the task names it lists
    exist, and only an admin points a run at a checkpoint path (it loads arbitrary weights on
    the shared workers) or gives it desktop slots or OSWorld VMs (each hands the policy a
    shell). `user` None: the command line, whose user has a shell already."""
    if data is not None and not isinstance(data, dict):
        problem = ConfigError("", f"the settings must be an object, got {type(data).__name__}")
        raise ConfigInvalid([problem])
    config = RunConfig.from_dict(data)
    problems: list[ConfigError] = []
    names = config.tasks.names
    if names:
        known = set(Task.objects.filter(name__in=names).values_list("name", flat=True))
        missing = [n for n in names if n not in known]
        if missing:
            problems.append(ConfigError("tasks.names", f"no task named {', '.join(missing)}"))
    if user is not None and not user.has_perm(CAN_ADMINISTER):
        if config.policy not in NAMED_POLICIES:
            problems.append(
                ConfigError(
                    "policy",
                    f"only an admin may point a run at a checkpoint path; use one of "
                    f"{', '.join(NAMED_POLICIES)}",
                )
            )
        if config.env.desktop_slots:
            problems.append(
                ConfigError("env.desktop_slots", "only an admin may give a run desktop slots")
            )
        if config.env.osworld_addresses:
            problems.append(
                ConfigError("env.osworld_addresses", "only an admin may give a run OSWorld VMs")
            )
    problems += _osworld_problems(config)
    if not any(p.path == "policy" for p in problems):  # one reason a policy is refused
        problems += _policy_root_problems(config)
    problems += _serving_problems(config)
    problems += _gpu_count_problems(config)
    problems += _memory_problems(config)
    if problems:
        raise ConfigInvalid(problems)
    return config


def _listed(items: list[str], limit: int = 10) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


def _serving_problems(config: RunConfig) -> list[ConfigError]:
    """The settings the shared inference workers would refuse request by request (they run at
    `rollout.limits.SHARED`, whatever run they serve). A run with its own processes starts
    its workers at its own budgets, so only a run on the shared stack is checked."""
    if config.policy == ORACLE_POLICY or processes_per_run():
        return []
    r = config.rollout
    refused = SHARED.refusals(
        max_new_tokens=r.max_new_tokens,
        max_prompt_tokens=r.max_prompt_tokens,
        max_images=r.max_images,
        lora_rank=config.trainer.lora_rank if r.backend == "vllm" else 0,
    )
    return [
        ConfigError(
            name,
            f"{why} on the shared inference workers (--processes shared), which serve every "
            "run with the same limits; a run with its own processes (a host agent) starts "
            "its workers at its own settings",
        )
        for name, why in refused
    ]


def _policy_root_problems(config: RunConfig) -> list[ConfigError]:
    """A checkpoint directory the run's inference workers would refuse to load: they load only
    from under the checkpoint roots (`rollout.auth.checkpoint_allowed`), and would fail at every
    start. Named policies and artifact references are under them by construction."""
    if config.policy in NAMED_POLICIES or is_ref(config.policy):
        return []
    resolved = Path(config.policy).resolve()
    roots = [Path(root).resolve() for root in settings.DARTBOARD_CHECKPOINT_ROOTS]
    if any(resolved.is_relative_to(root) for root in roots):
        return []
    return [
        ConfigError(
            "policy",
            f"{config.policy} is outside the checkpoint roots ({', '.join(map(str, roots))}), "
            "the only directories the inference workers load weights from: move the "
            "checkpoint under one of them, or add its directory to DARTBOARD_CHECKPOINT_ROOTS "
            "on every host",
        )
    ]


def _gpu_count_problems(config: RunConfig) -> list[ConfigError]:
    """A GPU run that asks for more GPUs than the whole cluster has (a run spreads over
    hosts, `hostagent.cluster`): refused with the cluster's totals, not queued for ever.
    Checked where host agents have reported GPUs."""
    hosts = gpu_hosts()
    if config.device != "cuda" or not hosts:
        return []
    # auto replicas ask for no more GPUs than there are (`trainer_layout`)
    r, trainer = config.rollout, 0 if config.policy == ORACLE_POLICY else config.trainer.replicas
    workers = 0 if config.policy == ORACLE_POLICY else r.inference_workers
    if r.backend == "vllm":  # one GPU each, the trainer's own when shared
        inference = 0 if r.vllm_gpus == "shared" else workers
    else:  # transformers workers share the GPUs the trainer leaves
        inference = min(workers, 1)
    needed = trainer + inference
    total = sum(hosts.values())
    if needed <= total:
        return []
    name = "trainer.replicas" if trainer > total else "rollout.inference_workers"
    return [
        ConfigError(
            name,
            f"the run needs {needed} GPUs ({trainer} for the trainer's replicas, {inference} "
            f"for inference), but the cluster has {total} ({len(hosts)} GPU "
            f"host{'s' if len(hosts) != 1 else ''}, the largest with {max(hosts.values())})",
        )
    ]


def _memory_problems(config: RunConfig) -> list[ConfigError]:
    """A trainer that no GPU of the cluster can hold, whatever its `auto` settings pick
    (`training.memory_plan`), with the plan's numbers and what would fit; a vLLM share of
    the GPU that cannot hold the weights and one request's KV cache. Checked where a
    host agent has reported GPUs its torch can use and the run may go there; a run that
    trains on the CPU, or a checkpoint not on this disk, is not planned here."""
    if config.policy == ORACLE_POLICY or config.device == "cpu":
        return []
    gpu_gib = largest_gpu_gib()
    if gpu_gib is None:
        return []
    r = config.rollout
    if is_ref(config.policy):
        return []  # in the store: not fetched to validate a form
    try:
        policy = policy_path(config.policy)
    except (OSError, ValueError):
        return []  # the policy's own check reports it
    request = run_trainer_request(
        policy,
        config.trainer,
        max_prompt_tokens=r.max_prompt_tokens,
        max_new_tokens=r.max_new_tokens,
        max_images=r.max_images,
    )
    if request is None:
        return []
    replicas, sharded = trainer_layout(
        config.trainer, request, gpu_gib=gpu_gib, gpus=sum(gpu_hosts().values())
    )
    request = replace(request, shards=replicas if sharded else 1)
    problems = []
    try:
        request.plan(gpu_gib)
    except DoesNotFit as exc:
        problems.append(ConfigError("trainer", str(exc)))
    if r.backend == "vllm":
        share = gpu_gib * r.vllm_gpu_memory
        short = vllm_fits(request.shape, context_tokens=request.sample.tokens, share_gib=share)
        if short:
            problems.append(ConfigError("rollout.vllm_gpu_memory", short))
    return problems


def _osworld_problems(config: RunConfig) -> list[ConfigError]:
    """The run's OSWorld tasks that no slot of it can host: what they need that the run's
    VMs do not offer (env.osworld_offers), and the files this host's cache lacks."""
    if "osworld" not in config.tasks.env_kinds:
        return []
    placements = osworld_placements(
        tasks=task_list(selection=config.tasks),
        offers=config.env.osworld_offers,
        cache=FileCache(settings.OSWORLD_FILE_CACHE),
    )
    problems = []
    lacking = [f"{p.task} needs {', '.join(p.lacks)}" for p in placements if p.lacks]
    if lacking:
        problems.append(
            ConfigError(
                "env.osworld_offers",
                f"{len(lacking)} OSWorld task(s) need what the run's VMs do not offer: "
                + _listed(lacking)
                + " (leave those tasks out, or add to osworld_offers what the VMs have)",
            )
        )
    files = [f"{p.task}: {', '.join(p.missing_files)}" for p in placements if p.missing_files]
    if files:
        problems.append(
            ConfigError(
                "tasks",
                f"{len(files)} OSWorld task(s) fetch files the file cache "
                f"({settings.OSWORLD_FILE_CACHE}) lacks: "
                + _listed(files, limit=5)
                + " (`manage.py osworld_cache fetch` or `osworld_cache add DIR` fills it)",
            )
        )
    return problems


def run_control_check(*, run: Run, user: User | None) -> None:
    """Raise NotYourRun unless `user` may start, pause, resume or stop `run`: its owner, an
    admin, anyone for a run without an owner (made from the command line), and the command
    line itself (`user` None). Holding the operator role is checked before, by the view."""
    if user is None or run.owner_id is None or run.owner_id == user.pk:
        return
    if user.has_perm(CAN_ADMINISTER):
        return
    owner = run.owner.get_username() if run.owner is not None else "another user"
    raise NotYourRun(
        f"run #{run.pk} belongs to {owner}: only its owner or an admin may start, pause, "
        "resume or stop it (copy it to run it yourself)"
    )


@transaction.atomic
def tasks_import(*, records: Iterable[TaskRecord]) -> tuple[int, int]:
    """Create or update tasks by name, all in one transaction. Returns (created, updated)."""
    created = updated = 0
    for rec in records:
        _, was_created = Task.objects.update_or_create(
            name=rec.name,
            defaults={
                "env_kind": rec.env_kind,
                "env_config": rec.env_config,
                "instruction": rec.instruction,
                "split": rec.split,
                "tags": list(rec.tags),
            },
        )
        created += was_created
        updated += not was_created
    return created, updated


@transaction.atomic
def tasks_set_split(*, names: Iterable[str], split: str, others: str | None = None) -> list[str]:
    """Put the tasks named in `split` (an OSWorld task id names `osworld/<id>`), and, with
    `others`, every other task in that one. Returns the names that match no task (then
    nothing is written)."""
    names = list(dict.fromkeys(names))
    known = set(Task.objects.values_list("name", flat=True))
    resolved = [n if n in known else osworld_task_name(n) for n in names]
    unknown = [n for n, r in zip(names, resolved, strict=True) if r not in known]
    if unknown:
        return unknown
    if others is not None:
        Task.objects.exclude(name__in=resolved).update(split=others)
    Task.objects.filter(name__in=resolved).update(split=split)
    return []


def run_create(*, name: str, config: RunConfig, owner: User | None = None) -> Run:
    """Store a run with its resolved config (every default filled in)."""
    return Run.objects.create(name=name, config=config.to_dict(), owner=owner)


_TRANSITIONS = {
    "start": ({RunStatus.CREATED, RunStatus.STOPPED, RunStatus.FAILED}, RunStatus.RUNNING),
    "pause": ({RunStatus.RUNNING}, RunStatus.PAUSED),
    "resume": ({RunStatus.PAUSED}, RunStatus.RUNNING),
    "stop": (
        {RunStatus.RUNNING, RunStatus.PAUSED, RunStatus.CREATED, RunStatus.QUEUED},
        RunStatus.STOPPED,
    ),
}


@transaction.atomic
def run_control(*, run_id: int, action: str, queue: bool = False) -> Run:
    """Start, pause, resume or stop a run; raise InvalidTransition with the reason.
    `queue`: a start waits as QUEUED for a host agent to bring up its processes
    (`run_begin` then makes it RUNNING)."""
    if action not in _TRANSITIONS:
        raise InvalidTransition(f"unknown action {action!r}; use start, pause, resume or stop")
    run = Run.objects.select_for_update(of=("self",)).get(pk=run_id)
    allowed, target = _TRANSITIONS[action]
    if run.status not in allowed:
        raise InvalidTransition(f"cannot {action} a run that is {run.status}")
    if action == "start" and queue:
        target = RunStatus.QUEUED
    run.status = target
    now = timezone.now()
    if action == "start":
        run.started_at = run.started_at or now
        run.finished_at = None
    if action == "stop":
        run.finished_at = now
    run.status_message = ""
    run.save(update_fields=["status", "started_at", "finished_at", "status_message", "updated_at"])
    return run


@transaction.atomic
def run_begin(*, run_id: int) -> bool:
    """A queued run whose processes are up becomes RUNNING. False if it is no longer queued
    (stopped while it waited)."""
    run = Run.objects.select_for_update(of=("self",)).get(pk=run_id)
    if run.status != RunStatus.QUEUED:
        return False
    run.status = RunStatus.RUNNING
    run.status_message = ""
    run.save(update_fields=["status", "status_message", "updated_at"])
    return True


@transaction.atomic
def run_finish(*, run_id: int, message: str) -> bool:
    """A running or paused run whose work is done (its trainer reached max_updates and its
    evaluations ended) becomes FINISHED, saying so; its processes stop with it. False if it
    was no longer running or paused (stopped meanwhile)."""
    run = Run.objects.select_for_update(of=("self",)).get(pk=run_id)
    if run.status not in (RunStatus.RUNNING, RunStatus.PAUSED):
        return False
    run.status = RunStatus.FINISHED
    run.finished_at = timezone.now()
    run.status_message = message
    run.save(update_fields=["status", "finished_at", "status_message", "updated_at"])
    return True


@transaction.atomic
def run_fail(*, run_id: int, message: str) -> bool:
    """A run that cannot go on (a process of it keeps failing at start) becomes FAILED,
    saying why; its data stays, and it may be started again once the cause is fixed. False
    if it had already ended."""
    run = Run.objects.select_for_update(of=("self",)).get(pk=run_id)
    if run.status in ENDED:
        return False
    run.status = RunStatus.FAILED
    run.finished_at = timezone.now()
    run.status_message = message
    run.save(update_fields=["status", "finished_at", "status_message", "updated_at"])
    return True


def run_fail_queued(*, run_id: int, message: str) -> None:
    """A queued run that cannot start (its policy is gone, say) fails, saying why."""
    Run.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
        status=RunStatus.FAILED, finished_at=timezone.now()
    )
    run_set_message(run_id=run_id, message=message)


def run_action_record(*, run_id: int, action: str, user: User | None, outcome: str) -> None:
    """Audit a run control attempt: who, what, when, and its outcome (a status or refusal)."""
    RunAction.objects.create(run_id=run_id, action=action[:16], user=user, outcome=outcome)


def run_set_message(*, run_id: int, message: str) -> None:
    """Say on the run what it is doing or waiting for (shown on the dashboard)."""
    Run.objects.filter(pk=run_id).update(status_message=message, updated_at=timezone.now())
