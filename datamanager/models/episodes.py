"""What a run collects and trains on: per-task statistics and groups, trajectories and their
steps, policy versions, env slots, trainer updates, reward overrides and evaluations."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from datamanager.models.runs import EnvKind, Run, Task
from rollout.episode import Outcome


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
    prompt_token_ids = models.BinaryField(
        default=b"",
        blank=True,
        help_text="The prompt's token ids as the policy's server tokenized it, image pads "
        "expanded (core.steps.pack_token_ids); the trainer trains on them. Empty for a "
        "demonstration recorded elsewhere, a scripted policy, or a step stored before they "
        "were kept (the trainer then encodes the stored prompt).",
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
