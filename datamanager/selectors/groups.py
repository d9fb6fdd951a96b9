"""Reads for the side-by-side views: one GRPO group's members, and two checkpoints' episodes
of the same task and seed with the first step where they part.

A group's members are its online rollouts (every status, so an errored or aborted member is
seen where it happened) and the experience-pool demos that joined it. A member's advantage
is the trainer's (`Step.advantage`, written by the update that used it) once it trained;
before that it is the advantage the trainer would give it now, from the same
`core.losses.group_advantages` over the group's trainable members, marked as expected.
"""

from __future__ import annotations

from dataclasses import dataclass

from datamanager.models import SCORED_STATUSES, EvalJob, Step, TaskGroup, Trajectory


@dataclass(frozen=True)
class Member:
    """One lane of the group view: a trajectory and its steps in order."""

    trajectory: Trajectory
    steps: list[Step]
    from_pool: bool  # an experience-pool demo that joined the group
    advantage: float | None
    advantage_trained: bool  # the trainer's own figure, not the expected one

    @property
    def end_reason(self) -> str:
        """How the episode ended: the rollout's own reason (finished, step_cap, ...), or the
        status when it never got to one (error, aborted, running)."""
        if self.trajectory.status in SCORED_STATUSES:
            return str(self.trajectory.details.get("end_reason") or self.trajectory.status)
        return str(self.trajectory.status)


@dataclass(frozen=True)
class GroupView:
    group: TaskGroup
    members: list[Member]
    width: int  # the longest member's step count: the lanes' common length

    @property
    def rewards(self) -> list[float | None]:
        return [m.trajectory.reward for m in self.members]


def _expected_advantages(trajs: list[Trajectory]) -> dict[int, float]:
    """What the trainer would give each trainable member now (0 for a group without spread)."""
    scored = [
        t for t in trajs if t.status in SCORED_STATUSES and not t.rejected and t.reward is not None
    ]
    if not scored:
        return {}
    # The trainer's own function; torch loads on the first group view a web process
    # serves, not on every web start.
    import torch

    from core.losses import group_advantages

    rewards = torch.tensor([float(t.reward or 0.0) for t in scored])
    advantages, _, _ = group_advantages(rewards, torch.zeros(len(scored), dtype=torch.long))
    return {t.pk: float(a) for t, a in zip(scored, advantages.tolist(), strict=True)}


def group_view(*, group_id: int) -> GroupView:
    """The group and its members, online rollouts first (in claim order), then pool demos.
    Raises TaskGroup.DoesNotExist."""
    group = TaskGroup.objects.select_related("run", "task").get(pk=group_id)
    online = list(
        Trajectory.objects.filter(group=group)
        .select_related("env_slot", "failure_label")
        .order_by("pk")
    )
    demos = list(
        Trajectory.objects.filter(pk__in=group.pool_members)
        .select_related("env_slot", "failure_label")
        .order_by("pk")
    )
    ids = [t.pk for t in online + demos]
    steps: dict[int, list[Step]] = {pk: [] for pk in ids}
    for step in Step.objects.filter(trajectory_id__in=ids).order_by("trajectory_id", "index"):
        steps[step.trajectory_id].append(step)
    expected = _expected_advantages(online + demos)
    members = []
    for traj in online + demos:
        trained = [s.advantage for s in steps[traj.pk] if s.advantage is not None]
        members.append(
            Member(
                trajectory=traj,
                steps=steps[traj.pk],
                from_pool=traj in demos,
                advantage=trained[0] if trained else expected.get(traj.pk),
                advantage_trained=bool(trained),
            )
        )
    width = max((len(m.steps) for m in members), default=0)
    return GroupView(group=group, members=members, width=width)


def first_divergence(a: list[dict | None], b: list[dict | None]) -> int | None:
    """The first step index where two episodes' actions differ, counting an episode that
    ended while the other went on as differing there; None when they are the same.

    Both episodes start from the same task and seed, so up to that step they saw the same
    screens (a deterministic environment): the first differing action is where the two
    checkpoints parted."""
    for index in range(max(len(a), len(b))):
        if index >= len(a) or index >= len(b) or a[index] != b[index]:
            return index
    return None


@dataclass(frozen=True)
class EpisodePair:
    a_job: EvalJob
    b_job: EvalJob
    task: str
    seed: int
    a: Trajectory | None
    b: Trajectory | None
    a_steps: list[Step]
    b_steps: list[Step]
    diverge_at: int | None

    @property
    def width(self) -> int:
        return max(len(self.a_steps), len(self.b_steps))


def eval_episode(*, job: EvalJob, task: str, seed: int) -> tuple[Trajectory | None, list[Step]]:
    """The job's (latest) episode of `task` with `seed`, and its steps."""
    traj = (
        Trajectory.objects.filter(eval_job=job, task__name=task, seed=seed)
        .select_related("task")
        .order_by("-pk")
        .first()
    )
    steps = list(Step.objects.filter(trajectory=traj).order_by("index")) if traj else []
    return traj, steps


def episode_pair(*, a_id: int, b_id: int, task: str, seed: int) -> EpisodePair:
    """Two evaluation jobs' episodes of one task and seed. Raises EvalJob.DoesNotExist."""
    a_job, b_job = EvalJob.objects.get(pk=a_id), EvalJob.objects.get(pk=b_id)
    a, a_steps = eval_episode(job=a_job, task=task, seed=seed)
    b, b_steps = eval_episode(job=b_job, task=task, seed=seed)
    diverge = (
        first_divergence([s.action for s in a_steps], [s.action for s in b_steps])
        if a and b
        else None
    )
    return EpisodePair(a_job, b_job, task, seed, a, b, a_steps, b_steps, diverge)


def shared_seeds(*, a_id: int, b_id: int) -> dict[str, list[int]]:
    """Per task, the seeds both jobs ran (what can be compared episode by episode)."""

    def seeds(job_id: int) -> set[tuple[str, int]]:
        rows = Trajectory.objects.filter(eval_job_id=job_id, seed__isnull=False)
        return {
            (task, seed)
            for task, seed in rows.values_list("task__name", "seed")
            if seed is not None
        }

    both: dict[str, list[int]] = {}
    for task, seed in sorted(seeds(a_id) & seeds(b_id)):
        both.setdefault(task, []).append(seed)
    return both
