"""The dashboard's roles, as Django groups: what each may do.

- viewer: read everything (runs, trajectories, evaluations, tasks, the live feed);
- operator: a viewer who also creates, starts, pauses, resumes and stops runs, curates
  trajectories and tasks, and uploads demonstrations;
- admin: an operator who also points a run's policy at any checkpoint path, gives it desktop
  slots (a shell for the policy), overrides rewards, and manages users.

A superuser (the admin `make run` creates) has every permission. `python manage.py
grant_role USER ROLE` puts a user in a role's group.

The run form refuses desktop slots and VMs to a non-admin; an env worker checks again
(`run_env_check`) before it starts one, since a task reaches it from whatever can send to the
broker, not only from the launcher.
"""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission

from datamanager.models import Run

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


# Environments that hand the policy a machine: a desktop slot's X session (a shell in a few
# clicks) or an OSWorld VM. An admin's call, as the run form says.
MACHINE_ENVS = {"desktop": "desktop slots", "osworld": "OSWorld VMs"}


class EnvNotGranted(PermissionError):
    """A slot or an evaluation asked for a desktop or a VM its run was not given."""


def run_env_check(*, run: Run, backend: str, index: int | None = None) -> None:
    """Raise EnvNotGranted unless `run` may put its policy on a `backend` env: for a desktop
    or an OSWorld VM, the run's config has that slot (`index`; any slot of the backend when
    None: an evaluation's episodes) and its owner holds the admin role now (a run without an
    owner was made from the command line, by someone with a shell). Other backends pass."""
    what = MACHINE_ENVS.get(backend)
    if what is None:
        return
    slots = [i for b, i in run.cfg.env.slots() if b == backend]
    if index is None and not slots:
        raise EnvNotGranted(f"run {run.pk} was given no {what}")
    if index is not None and index not in slots:
        raise EnvNotGranted(
            f"run {run.pk} has no {backend} slot {index} (it was given {len(slots)} {what})"
        )
    owner = run.owner
    if owner is not None and not owner.has_perm(CAN_ADMINISTER):
        raise EnvNotGranted(
            f"run {run.pk} belongs to {owner.get_username()}, who does not hold the admin "
            f"role: only an admin's run gets {what}"
        )
