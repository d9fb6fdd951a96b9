"""The data manager's tables: tasks, runs, per-task statistics, trajectories, steps,
policy versions, env slots and trainer updates.

Writes go through `datamanager.services.runs`, reads through `datamanager.selectors.tasks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings
from django.db import models

from core.protocol import TaskSpec
from rollout.episode import Outcome

if TYPE_CHECKING:
    from datamanager.config import RunConfig


class Split(models.TextChoices):
    TRAIN = "train"
    EVAL = "eval"


class EnvKind(models.TextChoices):
    MINIWOB = "miniwob"
    DESKTOP = "desktop"
    SIM = "sim"
    OSWORLD = "osworld"


class Task(models.Model):
    name = models.CharField(max_length=200, unique=True)
    env_kind = models.CharField(max_length=32, choices=EnvKind.choices)
    env_config = models.JSONField(default=dict, blank=True)
    instruction = models.TextField(blank=True, help_text="Empty when the environment sets it.")
    split = models.CharField(max_length=8, choices=Split.choices, default=Split.TRAIN)
    tags = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["split", "env_kind"])]

    def __str__(self) -> str:
        return self.name

    def spec(self, seed: int | None) -> TaskSpec:
        """What an environment is given for an episode of this task at `seed` (the one
        place a TaskSpec is made from a task)."""
        return TaskSpec(
            name=self.name,
            env_kind=self.env_kind,
            env_config=self.env_config,
            instruction=self.instruction,
            seed=seed,
        )


class RunStatus(models.TextChoices):
    CREATED = "created"
    # Started, waiting for a host agent to bring up its processes (or for room to do so).
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"


class Run(models.Model):
    name = models.CharField(max_length=200)
    config = models.JSONField(help_text="Resolved RunConfig (datamanager.config).")
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.CREATED)
    status_message = models.TextField(
        blank=True, help_text="What the run is doing or waiting for, or why it failed."
    )
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    paused_for_disk = models.BooleanField(
        default=False,
        help_text="Paused because a write found no space left; resumed once there is "
        "(workers/disk.py).",
    )

    class Meta:
        ordering = ["-created_at"]
        # The roles (datamanager/roles.py): viewers read, operators run and curate, admins
        # also choose policy paths and desktop slots and override rewards.
        permissions = [
            ("control_run", "Start, pause, resume and stop runs"),
            ("curate", "Curate trajectories and tasks, upload demonstrations"),
            ("administer", "Policy paths, desktop slots and reward overrides"),
        ]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk})"

    @property
    def cfg(self) -> RunConfig:
        """The run's settings, parsed from its row (the one place that does)."""
        from datamanager.config import RunConfig  # config imports this module

        return RunConfig.from_dict(self.config)


class Host(models.Model):
    """A machine whose host agent starts runs' processes, and what it said it has."""

    name = models.CharField(max_length=200, unique=True)
    address = models.CharField(
        max_length=200, default="127.0.0.1", help_text="Where other hosts reach its routers."
    )
    gpus = models.JSONField(
        default=list, blank=True, help_text='[{"index": 0, "name": ..., "memory_gib": ...}]'
    )
    cuda_torch = models.BooleanField(
        default=False, help_text="Whether the agent's torch build can use the GPUs."
    )
    cpu_cores = models.PositiveIntegerField(default=1)
    memory_gib = models.FloatField(default=0.0)
    cpu_inference_slots = models.PositiveIntegerField(
        default=2, help_text="CPU inference workers this host serves at once."
    )
    env_kinds = models.JSONField(default=list, blank=True)
    last_seen = models.DateTimeField()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class PlacementState(models.TextChoices):
    QUEUED = "queued"  # waiting for room
    STARTING = "starting"  # processes started, router not answering yet
    UP = "up"  # the run's processes serve it
    ENDED = "ended"  # stopped with the run


class RunPlacement(models.Model):
    """A run's own processes: on which host, which GPUs and ports, and why it waits.

    One per run started under a host agent (DARTBOARD_PROCESSES=per-run). A run with one
    uses its own router and its own Celery queues; a run without uses the shared ones."""

    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="placement")
    host = models.ForeignKey(Host, null=True, blank=True, on_delete=models.SET_NULL)
    state = models.CharField(
        max_length=16, choices=PlacementState.choices, default=PlacementState.QUEUED
    )
    reason = models.TextField(blank=True, help_text="Why it waits, or what failed.")
    plan = models.JSONField(
        default=dict, blank=True, help_text="Devices and ports (hostagent.placement.Placement)."
    )
    router_url = models.CharField(max_length=200, blank=True)
    queued_at = models.DateTimeField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["queued_at", "pk"]


class RunAction(models.Model):
    """Audit record of a run control action: who, what, when, and what came of it."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="actions")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    action = models.CharField(max_length=16)
    outcome = models.TextField(help_text="The run's status after it, or why it was refused.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]


class TaskStat(models.Model):
    """Per (run, task) statistics and the curation state derived from them."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="task_stats")
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="stats")
    attempts = models.PositiveIntegerField(default=0)
    successes = models.PositiveIntegerField(default=0)
    success_rate = models.FloatField(default=0.0, help_text="Rolling success rate.")
    rollout_budget = models.PositiveIntegerField(default=8)
    step_cap = models.PositiveIntegerField(default=15)
    pool_size = models.PositiveIntegerField(default=0)
    outstanding = models.IntegerField(
        default=0, help_text="Rollouts still to claim in the task's current group."
    )
    group_index = models.PositiveIntegerField(default=0)
    longest_success = models.PositiveIntegerField(null=True, blank=True)
    override_note = models.TextField(blank=True, help_text="Who changed pin/boost/retire, and why.")
    pinned_budget = models.PositiveIntegerField(null=True, blank=True)
    retired = models.BooleanField(default=False)
    boost = models.FloatField(default=1.0)
    last_success_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "task"], name="uniq_taskstat")]
        indexes = [models.Index(fields=["run", "-outstanding"])]


class GroupStatus(models.TextChoices):
    OPEN = "open"
    READY = "ready"
    TRAINED = "trained"
    SKIPPED = "skipped"


class TaskGroup(models.Model):
    """A GRPO group: the online rollouts of one task that share an advantage baseline."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="groups")
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="+")
    index = models.PositiveIntegerField()
    budget = models.PositiveIntegerField()
    claimed = models.PositiveIntegerField(default=0)
    # Members that ended in an environment error and got a replacement claim (budget grew).
    retries = models.PositiveIntegerField(default=0)
    status = models.CharField(max_length=8, choices=GroupStatus.choices, default=GroupStatus.OPEN)
    pool_members = models.JSONField(
        default=list, blank=True, help_text="Experience-pool trajectory ids joined to the group."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    note = models.TextField(blank=True, help_text="Why it was skipped, or what it is waiting for.")

    class Meta:
        ordering = ["run_id", "task_id", "index"]
        constraints = [models.UniqueConstraint(fields=["run", "task", "index"], name="uniq_group")]
        indexes = [models.Index(fields=["run", "status"])]


class TaskStatHistory(models.Model):
    """A task's curation state after each finished group (the budget/step-cap charts)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="+")
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="+")
    at = models.DateTimeField(auto_now_add=True)
    success_rate = models.FloatField(null=True)
    rollout_budget = models.PositiveIntegerField()
    step_cap = models.PositiveIntegerField()
    pool_size = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["run_id", "at"]
        indexes = [models.Index(fields=["run", "task", "at"])]


class TrajectoryStatus(models.TextChoices):
    RUNNING = "running"
    SUCCEEDED = Outcome.SUCCEEDED.value  # the runner's outcomes (rollout.episode.Outcome)
    FAILED = Outcome.FAILED.value
    ERROR = "error"
    ABORTED = "aborted"


# A trajectory that ran to its end and was scored by its environment: success rates and
# training count these (an error or an abort never got a verdict).
SCORED_STATUSES = (TrajectoryStatus.SUCCEEDED, TrajectoryStatus.FAILED)


class TrajectorySource(models.TextChoices):
    ONLINE = "online"
    PRECOLLECTED = "precollected"
    HUMAN = "human"
    CURATED = "curated"


class RewardSource(models.TextChoices):
    ENVIRONMENT = "environment"
    HUMAN = "human"


class Purpose(models.TextChoices):
    TRAIN = "train"
    EVAL = "eval"


class Trajectory(models.Model):
    run = models.ForeignKey(
        Run, null=True, blank=True, on_delete=models.CASCADE, related_name="trajectories"
    )
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="trajectories")
    env_slot = models.ForeignKey(
        "EnvSlot", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    status = models.CharField(
        max_length=16, choices=TrajectoryStatus.choices, default=TrajectoryStatus.RUNNING
    )
    reward = models.FloatField(null=True, blank=True)
    reward_source = models.CharField(
        max_length=16, choices=RewardSource.choices, default=RewardSource.ENVIRONMENT
    )
    reward_override_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reward_override_reason = models.TextField(blank=True)
    length = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    source = models.CharField(
        max_length=16, choices=TrajectorySource.choices, default=TrajectorySource.ONLINE
    )
    purpose = models.CharField(max_length=8, choices=Purpose.choices, default=Purpose.TRAIN)
    in_pool = models.BooleanField(default=False, help_text="In its task's experience pool.")
    rejected = models.BooleanField(
        default=False, help_text="Rejected by a curator: never trained on."
    )
    curated_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="curated_copies"
    )
    policy_versions = models.JSONField(default=list, blank=True)
    error = models.TextField(blank=True, help_text="Why the trajectory ended in error.")
    details = models.JSONField(default=dict, blank=True, help_text="The evaluator's details.")
    instruction = models.TextField(blank=True, help_text="The instruction the policy saw.")
    group = models.ForeignKey(
        "TaskGroup", null=True, blank=True, on_delete=models.SET_NULL, related_name="trajectories"
    )
    content_hash = models.CharField(
        max_length=64,
        blank=True,
        db_index=True,
        help_text="An imported demonstration's SHA-256 over its task, actions, texts and pixels.",
    )
    reviewed_at = models.DateTimeField(
        null=True, blank=True, help_text="When a curator accepted or rejected it."
    )
    reviewed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    step_cap = models.PositiveIntegerField(default=0, help_text="Step cap it ran under.")
    env_ms = models.FloatField(default=0.0, help_text="Time in reset/step/evaluate.")
    model_ms = models.FloatField(default=0.0, help_text="Time waiting for the policy.")
    seed = models.BigIntegerField(null=True, blank=True)
    eval_job = models.ForeignKey(
        "EvalJob", null=True, blank=True, on_delete=models.CASCADE, related_name="trajectories"
    )

    class Meta:
        ordering = ["-started_at"]
        indexes = [
            models.Index(fields=["task", "-started_at"]),
            models.Index(fields=["run", "status"]),
            models.Index(fields=["run", "-started_at"]),
            models.Index(fields=["task", "in_pool"]),
            # A finish reads its task's latest outcomes in this run (the rolling success
            # rate): without it, every finish sorted all of the task's trajectories.
            models.Index(fields=["run", "task", "-finished_at"], name="traj_run_task_finished"),
        ]

    def __str__(self) -> str:
        return f"trajectory #{self.pk} ({self.task_id}, {self.status})"


class Step(models.Model):
    trajectory = models.ForeignKey(Trajectory, on_delete=models.CASCADE, related_name="steps")
    index = models.PositiveIntegerField()
    screenshot = models.FileField(upload_to="screenshots/%Y/%m/%d/", blank=True)
    screen_width = models.PositiveIntegerField(default=0)
    screen_height = models.PositiveIntegerField(default=0)
    raw_output = models.TextField(blank=True)
    thought = models.TextField(blank=True)
    action = models.JSONField(null=True, blank=True)
    parse_error = models.TextField(blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    prompt = models.JSONField(
        default=list,
        blank=True,
        help_text="The messages the policy was given, its images as references to the "
        "trajectory's steps (core.prompts.prompt_messages); training reads them back. Empty "
        "for a demonstration recorded elsewhere.",
    )
    response_tokens = models.PositiveIntegerField(default=0)
    rollout_logprobs = models.JSONField(default=list, blank=True)
    response_token_ids = models.JSONField(
        default=list, blank=True, help_text="The sampled token ids (training re-uses them exactly)."
    )
    mean_entropy = models.FloatField(null=True, blank=True)
    policy_version = models.IntegerField(null=True, blank=True)
    env_ms = models.FloatField(null=True, blank=True)
    model_ms = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The trainer's view of the step, filled when an update uses (or rejects) it.
    trained_in_update = models.ForeignKey(
        "TrainUpdate", null=True, blank=True, on_delete=models.SET_NULL, related_name="steps"
    )
    entropy_kept = models.BooleanField(null=True, blank=True)
    advantage = models.FloatField(null=True, blank=True)
    is_weight = models.FloatField(null=True, blank=True)
    stale = models.BooleanField(default=False)
    train_uses = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["trajectory_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["trajectory", "index"], name="uniq_step_index")
        ]
        indexes = [models.Index(fields=["policy_version", "trained_in_update"])]


class PolicyVersion(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="policy_versions")
    version = models.PositiveIntegerField()
    checkpoint = models.CharField(max_length=500, help_text="Checkpoint location (storage key).")
    artifact = models.CharField(
        max_length=500,
        blank=True,
        help_text="The version in the artifact store (artifact:KEY@SHA256): what inference "
        "hosts and a trainer on another host fetch and verify.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    reached_workers = models.JSONField(default=list, blank=True)
    weights_bytes = models.BigIntegerField(default=0, help_text="Its weights on disk.")
    state_bytes = models.BigIntegerField(
        default=0, help_text="Its optimizer state on disk (what a trainer resumes from)."
    )
    pruned_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When its weights were deleted (trainer.versions_kept): its metrics stay.",
    )

    class Meta:
        ordering = ["run_id", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["run", "version"], name="uniq_policy_version")
        ]


class SlotStatus(models.TextChoices):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    RECOVERING = "recovering"
    QUARANTINED = "quarantined"
    STOPPED = "stopped"
    # Its worker's time slice ended (or its lockstep round had nothing left): the slot's task
    # is queued again and the next env worker that takes it serves it under a new row.
    RELEASED = "released"
    # Its run's trainer is behind: no new training claim until the backlog of ready steps
    # drops under curation.backpressure (an evaluation may still take the slot).
    HELD = "held"


def slot_key(name: str) -> str:
    """A slot's identity across the workers that serve it in turn: "backend:index" of its
    row's name (host:pid:backend:index, and an osworld slot's @VM)."""
    parts = name.split("@", 1)[0].split(":")
    return ":".join(parts[-2:]) if len(parts) >= 4 else name


class EnvSlot(models.Model):
    """One worker process's turn at serving a slot of a run. A slot moves between workers
    (time slices, restarts): its rows share `key`, and the newest heartbeat is the slot."""

    name = models.CharField(max_length=200, unique=True, help_text="host:pid:backend:index")
    key = models.CharField(
        max_length=64, blank=True, db_index=True, help_text="backend:index, the slot itself"
    )
    host = models.CharField(max_length=200)
    backend = models.CharField(max_length=32, choices=EnvKind.choices)
    status = models.CharField(
        max_length=16, choices=SlotStatus.choices, default=SlotStatus.STARTING
    )
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    current_trajectory = models.ForeignKey(
        Trajectory, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    consecutive_failures = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    env_busy_s = models.FloatField(
        default=0.0,
        help_text="Seconds this slot's environment has spent in reset/step/evaluate while "
        "served (the call under way included), as of the last heartbeat.",
    )
    sandbox_note = models.TextField(
        blank=True,
        help_text="Why this slot's sandboxes run without their memory/pids cgroup or task "
        "quota (the admin allowed it with DARTBOARD_ALLOW_UNLIMITED_SANDBOX); empty: enforced.",
    )
    disk_free_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="Free space on its worker's DARTBOARD_HOME disk."
    )
    disk_total_bytes = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def save(self, *args, **kwargs) -> None:
        if not self.key:
            self.key = slot_key(self.name)
        super().save(*args, **kwargs)


class TrainUpdate(models.Model):
    """One trainer update of a run, with the metrics the dashboard charts."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="updates")
    number = models.PositiveIntegerField()
    policy_version = models.PositiveIntegerField(help_text="Version being trained (pi_old).")
    created_at = models.DateTimeField(auto_now_add=True)
    metrics = models.JSONField(default=dict)

    class Meta:
        ordering = ["run_id", "number"]
        constraints = [models.UniqueConstraint(fields=["run", "number"], name="uniq_update")]


class RewardOverride(models.Model):
    """Audit record of a human reward override."""

    trajectory = models.ForeignKey(
        Trajectory, on_delete=models.CASCADE, related_name="reward_overrides"
    )
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    old_reward = models.FloatField(null=True)
    new_reward = models.FloatField()
    reason = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)


class EvalStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class EvalScope(models.TextChoices):
    """What a run's scheduled evaluation measures (empty for a job outside a schedule)."""

    EVAL_SPLIT = "eval_split", "the eval split"
    TRAIN_INSTANCES = "train_instances", "training instances"
    HELDOUT = "heldout", "held-out seeds"


class EvalJob(models.Model):
    """Evaluation of one policy on a task set: k episodes per task with fixed seeds."""

    name = models.CharField(max_length=200)
    policy = models.CharField(
        max_length=500, help_text="'oracle', a local HF checkpoint directory, or run:ID:vN."
    )
    run = models.ForeignKey(
        Run, null=True, blank=True, on_delete=models.CASCADE, related_name="eval_jobs"
    )
    policy_version = models.IntegerField(null=True, blank=True)
    task_names = models.JSONField(default=list)
    k = models.PositiveIntegerField(default=1)
    seed = models.BigIntegerField(default=0)
    greedy = models.BooleanField(default=True)
    temperature = models.FloatField(default=0.0)
    status = models.CharField(max_length=16, choices=EvalStatus.choices, default=EvalStatus.QUEUED)
    error = models.TextField(blank=True)
    done = models.PositiveIntegerField(default=0)
    total = models.PositiveIntegerField(default=0)
    shards = models.PositiveIntegerField(
        default=0, help_text="Env-slot tasks it runs on (0: run in-process, not watched)."
    )
    report = models.JSONField(default=dict, blank=True)
    scope = models.CharField(max_length=16, choices=EvalScope.choices, blank=True, default="")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["run", "policy_version"])]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk})"


class ServiceOutage(models.Model):
    """A time a service the platform needs (Redis, the database, the router, the inference
    workers, a run's trainer) was seen down by the web's health probes, with its error.
    `ended_at` is empty while it lasts. A database outage is written once it is back."""

    service = models.CharField(max_length=64, help_text="redis, database, router, ...")
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-started_at"]
        indexes = [models.Index(fields=["service", "ended_at"])]

    @property
    def duration_s(self) -> float | None:
        if self.ended_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds()


class FailureKind(models.TextChoices):
    """Why a rollout went wrong, as a person judged it in the annotation queue."""

    ENV_BUG = "env_bug", "environment bug"
    AGENT_MISTAKE = "agent_mistake", "agent mistake"
    REWARD_WRONG = "reward_wrong", "reward wrong"
    FINE = "fine", "fine"


class FailureLabel(models.Model):
    """A person's label on one trajectory (labelling again replaces it: who and when are the
    latest). An `env_bug` label leaves the trajectory out of training (`rejected`) and counts
    against its task and its slot's host."""

    trajectory = models.OneToOneField(
        Trajectory, on_delete=models.CASCADE, related_name="failure_label"
    )
    run = models.ForeignKey(
        Run, null=True, blank=True, on_delete=models.CASCADE, related_name="failure_labels"
    )
    label = models.CharField(max_length=16, choices=FailureKind.choices)
    comment = models.TextField(blank=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["run", "label"])]


class ExportStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class DatasetExport(models.Model):
    """A dataset written from the trajectory list's filter, in the background
    (`datamanager.services.exports`): its files sit under the media storage's exports/."""

    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    filter = models.JSONField(default=dict, help_text="The trajectory filter, as its query.")
    formats = models.JSONField(default=list, help_text="hf, sft, osworld.")
    status = models.CharField(
        max_length=8, choices=ExportStatus.choices, default=ExportStatus.QUEUED
    )
    done = models.PositiveIntegerField(default=0, help_text="Trajectories written.")
    total = models.PositiveIntegerField(default=0, help_text="Trajectories the filter matched.")
    archive = models.CharField(max_length=255, blank=True, help_text="Storage key of the .zip.")
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-created_at"]


class ApiToken(models.Model):
    """A user's token for the REST API and the `dartboard` command line
    (`datamanager.services.tokens`). It carries its user's roles. Only the SHA-256 of the
    secret is stored: the token itself is shown once, when it is made."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100, help_text="What the token is for.")
    key_id = models.CharField(
        max_length=16, unique=True, help_text="The token's public part, to find it by."
    )
    digest = models.CharField(max_length=64, help_text="SHA-256 of the whole token, hex.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} (dbt_{self.key_id}_…)"


class Sweep(models.Model):
    """Runs made from one config over a grid of settings and seeds, started `parallel` at a
    time as earlier ones end (`workers.sweeps`)."""

    name = models.CharField(max_length=200)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    config = models.JSONField(help_text="The base settings, before the grid and the seeds.")
    grid = models.JSONField(default=dict, help_text='{"trainer.lr": [1e-05, 5e-05]}')
    seeds = models.PositiveIntegerField(default=1, help_text="Seeds per grid point.")
    parallel = models.PositiveIntegerField(default=1, help_text="Members running at once.")
    created_at = models.DateTimeField(auto_now_add=True)
    stopped_at = models.DateTimeField(
        null=True, blank=True, help_text="Stopped: members not yet started never start."
    )

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} (sweep #{self.pk})"


class SweepMember(models.Model):
    """One run of a sweep: its grid point and seed."""

    sweep = models.ForeignKey(Sweep, on_delete=models.CASCADE, related_name="members")
    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="sweep_member")
    index = models.PositiveIntegerField()
    overrides = models.JSONField(help_text='What it changes, e.g. {"trainer.lr": 1e-05, "seed": 1}')
    launched_at = models.DateTimeField(
        null=True, blank=True, help_text="When the sweep started it (or tried to)."
    )

    class Meta:
        ordering = ["sweep_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["sweep", "index"], name="uniq_sweep_member_index")
        ]
