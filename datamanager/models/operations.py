"""The run's operations records: service outages, failure labels, dataset exports."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from datamanager.models.episodes import Trajectory
from datamanager.models.runs import Run


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
