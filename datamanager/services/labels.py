"""Failure labels from the annotation queue: why a rollout went wrong, and what that changes.

- `env_bug`: the environment, not the agent, failed; the rollout is left out of training
  (`rejected`, out of the experience pool) and counts against its task and its slot's host;
- `reward_wrong`: the evaluator scored it wrongly; the view sends the labeller on to the
  audited reward override (an admin's), and the label stays as the reason to look;
- `agent_mistake`, `fine`: recorded and counted; training uses the rollout as before.

Labelling again replaces the label (its who and when are the latest). A rollout an
`env_bug` label rejected stays rejected when relabelled: its group may already have trained
without it, and un-rejecting is a curator's decision, not a side effect of a keypress.
"""

from __future__ import annotations

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from datamanager.models import FailureKind, FailureLabel, Trajectory, TrajectoryStatus
from datamanager.services.review import CurationError, trajectory_reject

MAX_COMMENT = 2000


@transaction.atomic
def trajectory_label(
    *, trajectory_id: int, label: str, comment: str, user: User | None
) -> FailureLabel:
    """Store `label` on the trajectory and apply it (module docstring). Raises CurationError
    for an unknown label, a running trajectory or an over-long comment."""
    if label not in FailureKind.values:
        raise CurationError(f"unknown label {label!r}; labels: {', '.join(FailureKind.values)}")
    if len(comment) > MAX_COMMENT:
        raise CurationError(f"the comment is {len(comment)} characters; at most {MAX_COMMENT}")
    traj = Trajectory.objects.select_for_update(of=("self",)).get(pk=trajectory_id)
    if traj.status == TrajectoryStatus.RUNNING:
        raise CurationError("the trajectory is still running; label it once it has ended")
    stored, _ = FailureLabel.objects.update_or_create(
        trajectory=traj,
        defaults={
            "run_id": traj.run_id,
            "label": label,
            "comment": comment.strip(),
            "user": user,
            "created_at": timezone.now(),
        },
    )
    if label == FailureKind.ENV_BUG and not traj.rejected:
        trajectory_reject(trajectory_id=traj.pk)
    return stored
