"""The dashboard's roles, as Django groups: what each may do.

- viewer: read everything (runs, trajectories, evaluations, tasks, the live feed);
- operator: a viewer who also creates, starts, pauses, resumes and stops runs, curates
  trajectories and tasks, and uploads demonstrations;
- admin: an operator who also points a run's policy at any checkpoint path, gives it desktop
  slots (a shell for the policy), overrides rewards, and manages users.

A superuser (the admin `make run` creates) has every permission. `python manage.py
grant_role USER ROLE` puts a user in a role's group.
"""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission

VIEW = [
    f"datamanager.view_{model}"
    for model in (
        "run",
        "task",
        "taskstat",
        "taskgroup",
        "trajectory",
        "step",
        "policyversion",
        "envslot",
        "trainupdate",
        "evaljob",
        "rewardoverride",
        "runaction",
    )
]
OPERATE = ["datamanager.add_run", "datamanager.control_run", "datamanager.curate"]
ADMINISTER = [
    "datamanager.administer",
    "auth.view_user",
    "auth.add_user",
    "auth.change_user",
    "auth.view_group",
]
ROLES: dict[str, list[str]] = {
    "viewer": VIEW,
    "operator": VIEW + OPERATE,
    "admin": VIEW + OPERATE + ADMINISTER,
}

# The permission each kind of request needs (views, the live socket).
CAN_VIEW = "datamanager.view_run"
CAN_CREATE = "datamanager.add_run"
CAN_CONTROL = "datamanager.control_run"
CAN_CURATE = "datamanager.curate"
CAN_ADMINISTER = "datamanager.administer"


def role_group(role: str) -> Group:
    """The role's group with exactly its permissions (created if missing, e.g. after a test
    flushed the tables the migration filled)."""
    if role not in ROLES:
        raise ValueError(f"no role {role!r}; roles: {', '.join(ROLES)}")
    group, _ = Group.objects.get_or_create(name=role)
    perms = []
    for perm in ROLES[role]:
        app_label, codename = perm.split(".")
        perms.append(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    group.permissions.set(perms)
    return group
