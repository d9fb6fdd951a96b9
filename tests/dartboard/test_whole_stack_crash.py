"""The whole stack killed at once, mid-update and mid-evaluation, and started again.

The launcher is `make run`'s (`manage.py run_dartboard` with its host agent, which starts the
run's own processes; tests/whole_stack.py) on its own DARTBOARD_HOME and embedded Redis, on
the suite's database, with short leases and a fast watchdog (tests/live_stack.py
FAST_LIVENESS). The run is tiny: two chromium slots, the shipped policy, groups of two, every
version evaluated on three held-out episodes. The launcher and every process it started
(web, Celery workers, beat, the embedded Redis, the run's env workers with chromium, trainer,
inference worker and router) are SIGKILLed together the moment the trainer is in an update
and an evaluation is in its last episode, then the launcher is started again on the same
home. Once the run collects again: the episodes the kill cut ended `aborted` and nothing from
before is left running; policy versions, updates and each trajectory's steps have no gap;
every screenshot a step names is a whole PNG on disk; the evaluation that was under way
finished (the watchdog finishes a job whose last episode it ended: no shard is left to); no
group is stuck open. And the restarted trainer's next update keeps them without a gap.
One kill for both moments: a start of the stack takes 30-60 s on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from datamanager.models import TrainUpdate
from tests.live_stack import FAST_LIVENESS
from tests.whole_stack import (
    CrashStack,
    crash_run_create,
    eval_last_episode_under_way,
    recovery_problems,
    update_under_way,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def crash_stack(subprocess_env, tmp_path, settings) -> Iterator[CrashStack]:
    settings.DARTBOARD_PROCESSES = "per-run"  # a started run waits for the launcher's agent
    stack = CrashStack(home=tmp_path / "home", env={**subprocess_env, **FAST_LIVENESS})
    try:
        yield stack
    finally:
        stack.stop()


def test_the_whole_stack_killed_mid_update_and_mid_evaluation_comes_back_whole(crash_stack):
    stack = crash_stack
    run = crash_run_create()
    stack.start()
    cut = stack.crash_when(
        # The update's check last: the stack is stopped while they are checked, but a commit
        # sent just before may still land, and an update ends in one commit where an
        # evaluation's last episode takes seconds.
        lambda: eval_last_episode_under_way(run.pk) and update_under_way(run.pk),
        run_id=run.pk,
        timeout=300,  # the two coincide by chance, later on a slower machine
        what="a trainer update and the last episode of an evaluation under way at once",
    )
    assert cut.moment == "update + evaluation" and cut.eval_jobs and cut.running, cut
    updates = TrainUpdate.objects.filter(run=run).count()

    restarted, _ = stack.come_back(cut, timeout=120)
    media = stack.home / "media"
    assert recovery_problems(cut, media_root=media, restarted=restarted) == {}
    # The update the kill cut was never recorded: the restarted trainer's first one follows
    # with the next number and publishes the next version.
    stack.wait(lambda: TrainUpdate.objects.filter(run=run).count() > updates, timeout=90,
               what="an update by the restarted trainer")  # fmt: skip
    assert recovery_problems(cut, media_root=media, restarted=restarted) == {}
