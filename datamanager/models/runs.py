"""Tasks, runs and what owns or places them: the task catalogue, runs with their status,
config and actions, hosts and placements, the runs' process logs, API tokens, sweeps."""

from __future__ import annotations

import copy

from django.conf import settings
from django.db import models

from core.protocol import TaskSpec
from datamanager.config import EnvKind, RunConfig


class Split(models.TextChoices):
    TRAIN = "train"
    EVAL = "eval"


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
        """The run's settings, parsed from its row once per loaded instance (the one place a
        stored run is parsed); parsed again only when `config` no longer equals what was
        parsed (reassigned, changed in place, or reloaded by refresh_from_db). Read it once
        where the run is loaded and pass it down; treat it as read-only."""
        parsed = self.__dict__.get("_cfg_parsed")
        if parsed is None or parsed[0] != self.config:
            parsed = (copy.deepcopy(self.config), RunConfig.from_dict(self.config))
            self.__dict__["_cfg_parsed"] = parsed
        return parsed[1]


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
    cpu_trainer_slots = models.PositiveIntegerField(
        null=True, blank=True, help_text="CPU trainer replicas it takes at once (empty: any)."
    )
    env_slots = models.PositiveIntegerField(
        null=True, blank=True, help_text="Env workers it runs at once (empty: any)."
    )
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
    """A run's own processes: on which hosts, which GPUs and ports, and why it waits.

    One per run started under a host agent (DARTBOARD_PROCESSES=per-run). A run with one
    uses its own router and its own Celery queues; a run without uses the shared ones.
    `host` is the host that answers for the run (its router's, else its trainer's); `hosts`
    every host with a part of it (`hostagent.cluster.ClusterPlacement`, in `plan`)."""

    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="placement")
    host = models.ForeignKey(Host, null=True, blank=True, on_delete=models.SET_NULL)
    hosts = models.ManyToManyField(Host, blank=True, related_name="run_parts")
    state = models.CharField(
        max_length=16, choices=PlacementState.choices, default=PlacementState.QUEUED
    )
    reason = models.TextField(blank=True, help_text="Why it waits, or what failed.")
    plan = models.JSONField(
        default=dict,
        blank=True,
        help_text="Each host's part: devices and ports (hostagent.cluster.ClusterPlacement).",
    )
    router_url = models.CharField(max_length=200, blank=True)
    queued_at = models.DateTimeField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["queued_at", "pk"]


class RunProcessLog(models.Model):
    """The end of one of a run's process logs, copied from its host by the host agent
    (`hostagent.log_ship`, secrets redacted), so the web, the API and the command line read
    it without a shell there, and after the host is gone."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="process_logs")
    host = models.CharField(max_length=200, help_text="The host the process runs on.")
    process = models.CharField(max_length=200, help_text='Its name in the run: "inference-0".')
    tail = models.TextField(blank=True, help_text="The log's last lines, at most a bound.")
    size = models.BigIntegerField(default=0, help_text="The whole log's size, in bytes.")
    running = models.BooleanField(
        default=True, help_text="Whether the process ran when the tail was copied."
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["host", "process"]
        constraints = [
            models.UniqueConstraint(fields=["run", "host", "process"], name="uniq_run_process_log")
        ]


class RunAction(models.Model):
    """Audit record of a run control action: who, what, when, and what came of it."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="actions")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    action = models.CharField(max_length=16)
    outcome = models.TextField(help_text="The run's status after it, or why it was refused.")
    created_at = models.DateTimeField(auto_now_add=True)

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
    time as earlier ones end (`datamanager.services.sweeps`)."""

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
