from django.contrib import admin

from datamanager import models


@admin.register(models.Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = ("name", "env_kind", "split", "tags")
    list_filter = ("env_kind", "split")
    search_fields = ("name", "instruction")


@admin.register(models.Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("name", "status", "owner", "created_at")
    list_filter = ("status",)


@admin.register(models.TaskStat)
class TaskStatAdmin(admin.ModelAdmin):
    list_display = (
        "run",
        "task",
        "attempts",
        "successes",
        "success_rate",
        "rollout_budget",
        "step_cap",
    )
    list_filter = ("run",)


class StepInline(admin.TabularInline):
    model = models.Step
    extra = 0
    fields = (
        "index",
        "action",
        "parse_error",
        "policy_version",
        "mean_entropy",
        "env_ms",
        "model_ms",
    )
    readonly_fields = fields


@admin.register(models.Trajectory)
class TrajectoryAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "run",
        "task",
        "status",
        "reward",
        "length",
        "source",
        "purpose",
        "in_pool",
    )
    list_filter = ("status", "source", "purpose", "in_pool")
    inlines = [StepInline]


@admin.register(models.PolicyVersion)
class PolicyVersionAdmin(admin.ModelAdmin):
    list_display = ("run", "version", "checkpoint", "created_at")


@admin.register(models.EnvSlot)
class EnvSlotAdmin(admin.ModelAdmin):
    list_display = ("name", "backend", "status", "run", "last_heartbeat", "consecutive_failures")
    list_filter = ("status", "backend")


@admin.register(models.TrainUpdate)
class TrainUpdateAdmin(admin.ModelAdmin):
    list_display = ("run", "number", "policy_version", "created_at")


@admin.register(models.RewardOverride)
class RewardOverrideAdmin(admin.ModelAdmin):
    list_display = ("trajectory", "user", "old_reward", "new_reward", "created_at")
