"""Killing any worker of a live run: the launcher's supervisor restarts the process, the
watchdog (Celery beat) brings back the slot or trainer task the dead worker held, the run
goes on, and no finished trajectory is lost.

The stack is `make run`'s (dartboard.launcher.default_specs): Celery env workers with real
chromium, the trainer worker, the rollout worker that runs the watchdog, Celery beat, one
transformers inference worker with the shipped tiny policy, and the router. Each worker is
killed with SIGKILL, so it gets no chance to hand its task back.
"""

from __future__ import annotations

import pytest

from datamanager.models import PolicyVersion, Run, Step, TrainUpdate, Trajectory
from tests.live_stack import create_started_run, finished, finished_after, live_stack
from workers.runs import run_start_workers

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def stack(subprocess_env, settings, tmp_path, live_work_keys_cleared):
    with live_stack(subprocess_env, tmp_path) as stack:
        settings.DARTBOARD_INFERENCE_URLS = [stack.router]
        yield stack


def _start_run() -> Run:
    run = create_started_run("faults")
    run_start_workers(run_id=run.pk)
    return run


def test_killing_each_worker_mid_run_loses_no_finished_trajectory_and_the_run_goes_on(stack):
    run = _start_run()
    stack.wait(
        lambda: len(finished(run)) >= 4 and TrainUpdate.objects.filter(run=run).exists(),
        timeout=300,
        what="4 finished episodes and a first update",
    )

    # 1. An env worker, mid-episode if it is in one.
    before = finished(run)
    pid, killed_at = stack.kill("worker-env-0")
    running_then = list(
        Trajectory.objects.filter(
            run=run, status="running", env_slot__name__contains=f":{pid}:"
        ).values_list("pk", flat=True)
    )
    new = stack.wait(
        lambda: finished_after(run, killed_at, not_on_pid=stack.pid("worker-env-1")),
        timeout=180,
        what="an episode finished by the restarted env worker",
    )
    assert f":{stack.pid('worker-env-0')}:" in new[0].env_slot.name
    for pk in running_then:  # the killed worker's episode ends with the reason, not silently
        t = stack.wait(
            lambda pk=pk: Trajectory.objects.exclude(status="running").filter(pk=pk).first(),
            timeout=60,
            what="the killed worker's episode to be ended",
        )
        assert t.status == "aborted" and "env worker stopped" in t.error

    # 2. The trainer worker: a new one resumes from the last published version.
    last_update = TrainUpdate.objects.filter(run=run).order_by("-number").first()
    published = PolicyVersion.objects.filter(run=run).order_by("-version").first()
    assert last_update is not None and published is not None
    stack.kill("worker-train")
    resumed = stack.wait(
        lambda: (
            TrainUpdate.objects.filter(run=run, number__gt=last_update.number)
            .order_by("number")
            .first()
        ),
        timeout=240,
        what="an update by the restarted trainer",
    )
    newest = PolicyVersion.objects.filter(run=run, version__lt=resumed.policy_version + 1)
    assert resumed.policy_version == newest.order_by("-version").first().version
    assert resumed.policy_version >= published.version

    # 3. The inference worker: episodes fail while it is away, then go on with the current
    # policy (the restarted worker starts from the launch version and is reloaded first).
    target = PolicyVersion.objects.filter(run=run).order_by("-version").first().version
    _, killed_at = stack.kill("inference-0")
    back = stack.wait(
        lambda: [
            t for t in finished_after(run, killed_at) if Step.objects.filter(trajectory=t).exists()
        ],
        timeout=180,
        what="an episode answered by the restarted inference worker",
    )
    versions = set(Step.objects.filter(trajectory=back[0]).values_list("policy_version", flat=True))
    assert min(versions) >= target

    # Nothing finished was lost or changed, and no step was trained twice.
    after = finished(run)
    assert {pk: after.get(pk) for pk in before} == before
    assert not Step.objects.filter(trajectory__run=run, train_uses__gt=1).exists()
