"""The multi-host test's eyes on host A: it runs there, with host A's configuration, and
answers the test over stdin/stdout, one JSON line per request:

    {"op": "start", "policy": ref}   -> {"run": id}   a run of that policy created, started,
                                                      its workers enqueued
    {"op": "start", "policy": ref, "set": {...}, "agents": true}
                                     -> {"run": id}   with those settings ("trainer.replicas":
                                                      2), left to the host agents to start
    {"op": "cluster", "run": id}     -> the run's status, its placement (hosts, parts), its
                                        versions, updates and trajectories
    {"op": "state", "run": id}       -> the run's trajectories, versions, updates, the router's
                                        workers, and the env wall as the web on A serves it
    {"op": "stop", "run": id}        -> {}            the run stopped (its workers wind down)

The test's own process sits outside every namespace it made, so it reaches the database,
Redis, the web and the router only through this process (which reaches them over the
test's veth addresses, as any process on host A does).

    ip netns exec <host A> python -m tests.multihost_observer
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import django


def _start(policy: str, settings: dict[str, Any], agents: bool) -> dict[str, Any]:
    from core.config_fields import config_override
    from datamanager.config import RunConfig
    from datamanager.services.run_workers import run_apply, run_start_workers
    from datamanager.services.runs import run_control, run_create
    from tests.live_stack import fault_run_config

    data = {**fault_run_config().to_dict(), "policy": policy}
    for path, value in settings.items():
        data = config_override(data, path, value)
    run = run_create(name="multi-host", config=RunConfig.from_dict(data))
    if agents:  # queued for the host agents, which start its processes and its work
        run_apply(run_id=run.pk, action="start")
    else:  # the shared workers serve it
        run_control(run_id=run.pk, action="start")
        run_start_workers(run_id=run.pk)
    return {"run": run.pk}


def _cluster(run_id: int) -> dict[str, Any]:
    from datamanager.models import PolicyVersion, Run, RunPlacement, TrainUpdate, Trajectory

    run = Run.objects.get(pk=run_id)
    placement = RunPlacement.objects.filter(run_id=run_id).first()
    return {
        "status": run.status,
        "message": run.status_message,
        "placement": None
        if placement is None
        else {
            "state": placement.state,
            "reason": placement.reason,
            "host": placement.host.name if placement.host else "",
            "hosts": sorted(placement.hosts.values_list("name", flat=True)),
            "plan": placement.plan,
            "router_url": placement.router_url,
        },
        "versions": list(
            PolicyVersion.objects.filter(run_id=run_id)
            .order_by("version")
            .values_list("version", flat=True)
        ),
        "updates": TrainUpdate.objects.filter(run_id=run_id).count(),
        "trajectories": [
            {"id": t.pk, "status": t.status, "host": t.env_slot.host if t.env_slot else ""}
            for t in Trajectory.objects.filter(run_id=run_id).select_related("env_slot")
        ],
    }


def _session_cookie() -> str:
    """A logged-in session of an operator (stored in the shared database, so the web on A
    accepts it)."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    user, _ = get_user_model().objects.get_or_create(
        username="operator", defaults={"is_superuser": True, "is_staff": True}
    )
    client = Client()
    client.force_login(user)
    return str(client.cookies["sessionid"].value)


def _state(run_id: int, cookie: str) -> dict[str, Any]:
    import httpx
    from django.conf import settings

    from datamanager.models import PolicyVersion, Step, TrainUpdate, Trajectory
    from rollout.client import RouterAdmin

    trajectories = []
    for t in Trajectory.objects.filter(run_id=run_id).select_related("env_slot").order_by("pk"):
        trajectories.append(
            {
                "id": t.pk,
                "status": t.status,
                "error": t.error[:300],
                "slot": t.env_slot.name if t.env_slot else "",
                "host": t.env_slot.host if t.env_slot else "",
                "steps": t.steps.count(),
                "versions": sorted(
                    set(Step.objects.filter(trajectory=t).values_list("policy_version", flat=True))
                    - {None}
                ),
                "started": t.started_at.isoformat(),
            }
        )
    versions = [
        {"version": v.version, "artifact": v.artifact, "reached": v.reached_workers}
        for v in PolicyVersion.objects.filter(run_id=run_id).order_by("version")
    ]
    router = settings.DARTBOARD_INFERENCE_URLS[0]
    with RouterAdmin(router, token=settings.DARTBOARD_ADMIN_TOKEN) as admin:
        workers = [w.__dict__ for w in admin.workers()]
    web = os.environ["MULTIHOST_WEB"]
    wall = httpx.get(f"{web}/runs/{run_id}/slots.json", cookies={"sessionid": cookie}, timeout=30)
    page = httpx.get(f"{web}/runs/{run_id}/", cookies={"sessionid": cookie}, timeout=30)
    return {
        "trajectories": trajectories,
        "versions": versions,
        "updates": TrainUpdate.objects.filter(run_id=run_id).count(),
        "router_workers": workers,
        "wall_status": wall.status_code,
        "wall": wall.json()["slots"] if wall.status_code == 200 else [],
        "page_status": page.status_code,
    }


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
    django.setup()
    from django.db import connection

    cookie = ""
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "start":
                agents = bool(request.get("agents"))
                reply = _start(str(request["policy"]), request.get("set", {}), agents)
                cookie = "" if agents else _session_cookie()
            elif request["op"] == "cluster":
                reply = _cluster(int(request["run"]))
            elif request["op"] == "state":
                reply = _state(int(request["run"]), cookie)
            elif request["op"] == "stop":
                from datamanager.services.runs import run_control

                run_control(run_id=int(request["run"]), action="stop")
                reply = {}
            else:
                reply = {"error": f"unknown op {request['op']!r}"}
        except Exception as exc:  # the test shows it; the observer stays up
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        connection.close()  # a fresh connection per request: the test may restart things
        print(json.dumps(reply, default=str), flush=True)


if __name__ == "__main__":
    main()
