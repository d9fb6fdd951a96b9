"""The episode lifecycle applies DART's curation to the data a user sees."""

import pytest

from datamanager.models import GroupStatus, Step, TaskGroup, TaskStat, TaskStatHistory, Trajectory
from datamanager.services import episodes
from tests.datamanager.factories import make_running_run, make_tasks, play, step_record

pytestmark = pytest.mark.django_db


def test_rollout_wise_claims_spread_over_tasks_without_a_barrier():
    make_tasks(2)
    run = make_running_run({"curation": {"n_max": 3}})
    claims = [
        episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)) for _ in range(6)
    ]
    names = [c.task.name for c in claims]
    assert sorted(names) == ["miniwob/t0"] * 3 + ["miniwob/t1"] * 3
    # Nothing finished yet, yet a seventh claim is served: the next groups open at once.
    seventh = episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
    assert seventh is not None
    assert TaskGroup.objects.filter(run=run).count() == 4


def test_a_claim_held_by_backpressure_completes_a_begun_group_and_opens_none():
    make_tasks(2)
    run = make_running_run({"curation": {"n_max": 2, "dynamic_budget": False}})

    def claim(begun_only):
        return episodes.task_claim(
            run_id=run.pk, slot_id=None, env_kinds=("miniwob",), begun_only=begun_only
        )

    assert claim(True) is None  # nothing begun yet: a held slot waits
    first = claim(False)
    second = claim(True)  # the begun group's other rollout
    assert second is not None and second.task_id == first.task_id
    assert claim(True) is None  # that group is complete; the other task's is not begun
    groups = TaskGroup.objects.filter(run=run).order_by("task_id")
    assert [(g.task_id == first.task_id, g.claimed) for g in groups] == [(True, 2), (False, 0)]
    assert TaskGroup.objects.filter(run=run).count() == 2  # no round opened by a held claim
    for _ in range(2):
        assert claim(False) is not None
    assert claim(True) is None  # every group claimed: a held claim opens no new round
    assert TaskGroup.objects.filter(run=run).count() == 2


def _claims(run, n):
    return [
        episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)) for _ in range(n)
    ]


def test_a_groups_rollouts_start_from_one_screen_and_sample_differently():
    """GRPO compares outcomes from the same start state: every rollout of a group gets the
    group's environment seed, each its own decoding seed; the next group a new screen."""
    make_tasks(1)
    run = make_running_run({"curation": {"n_max": 3}})
    first, second = _claims(run, 3), _claims(run, 3)
    assert len({c.task.seed for c in first}) == 1 and len({c.task.seed for c in second}) == 1
    assert first[0].task.seed != second[0].task.seed
    decode = [c.decode_seed for c in first + second]
    assert len(set(decode)) == 6
    # What the dashboard shows for a trajectory is the screen it played.
    assert Trajectory.objects.get(pk=first[1].trajectory_id).seed == first[0].task.seed


def test_fixed_training_instances_cycle_and_an_eval_job_can_replay_them():
    from datamanager.curation import INSTANCE_SEED_BASE

    make_tasks(1)
    run = make_running_run({"seed": 3, "tasks": {"instances": 2}, "curation": {"n_max": 2}})
    seeds = [c.task.seed for c in _claims(run, 8)]  # four groups of two
    base = (INSTANCE_SEED_BASE + 3) * 1000
    assert seeds == [base, base, base + 1, base + 1, base, base, base + 1, base + 1]


def test_group_becomes_ready_when_all_its_rollouts_finish_and_budget_shrinks_with_success():
    (task,) = make_tasks(1)
    run = make_running_run({"curation": {"n_max": 4, "n_min": 2, "budget_threshold": 0.6}})
    for _ in range(4):
        play(run, success=True, steps=3)
    group = TaskGroup.objects.get(run=run, index=1)
    assert group.status == GroupStatus.READY and group.budget == 4
    stat = TaskStat.objects.get(run=run, task=task)
    assert stat.success_rate == 1.0 and stat.rollout_budget == 2  # floor(9/1 - 7)
    assert stat.step_cap == 3 + 2  # longest success + margin
    assert TaskStatHistory.objects.filter(run=run, task=task).last().rollout_budget == 2
    # The next group uses the shrunken budget.
    play(run, success=True)
    assert TaskGroup.objects.get(run=run, index=2).budget == 2


def test_dynamic_budget_and_step_cap_can_be_switched_off():
    (task,) = make_tasks(1)
    run = make_running_run(
        {
            "curation": {
                "n_max": 2,
                "n_min": 2,
                "dynamic_budget": False,
                "dynamic_step_cap": False,
                "default_step_cap": 9,
            }
        }
    )
    play(run, success=True, steps=3)
    play(run, success=True, steps=3)
    stat = TaskStat.objects.get(run=run, task=task)
    assert stat.rollout_budget == 2 and stat.step_cap == 9


def test_all_failed_group_gets_pool_successes_and_not_when_disabled():
    (task,) = make_tasks(1)
    demo = Trajectory.objects.create(
        task=task, status="succeeded", reward=1.0, source="precollected", in_pool=True
    )
    run = make_running_run({"curation": {"n_max": 4, "pool_ratio": 0.25}})
    for _ in range(4):
        play(run, success=False)
    assert TaskGroup.objects.get(run=run, index=1).pool_members == [demo.pk]

    off = make_running_run({"curation": {"n_max": 4, "experience_pool": False}})
    for _ in range(4):
        play(off, success=False)
    assert TaskGroup.objects.get(run=off, index=1).pool_members == []


def test_environment_errors_do_not_count_as_policy_failures():
    (task,) = make_tasks(1)
    run = make_running_run({"curation": {"n_max": 2}})
    claim = episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
    episodes.trajectory_finish(
        trajectory_id=claim.trajectory_id,
        status="error",
        reward=None,
        error="EnvUnavailable: chromium died",
    )
    play(run, success=True)
    stat = TaskStat.objects.get(run=run, task=task)
    assert stat.attempts == 1 and stat.successes == 1
    traj = Trajectory.objects.get(pk=claim.trajectory_id)
    assert traj.status == "error" and "chromium died" in traj.error
    # The errored member was replaced: the group is ready once two rollouts were scored.
    assert TaskGroup.objects.get(run=run, index=1).status == GroupStatus.OPEN
    play(run, success=False)
    group = TaskGroup.objects.get(run=run, index=1)
    assert (group.status, group.budget, group.retries) == (GroupStatus.READY, 3, 1)


def test_steps_record_version_screenshot_and_trajectory_versions():
    make_tasks(1)
    run = make_running_run()
    tid = play(run, success=True, steps=2, version=3)
    steps = list(Step.objects.filter(trajectory_id=tid))
    assert [s.index for s in steps] == [0, 1]
    assert all(s.policy_version == 3 and s.screenshot.name.endswith(".png") for s in steps)
    traj = Trajectory.objects.get(pk=tid)
    assert traj.policy_versions == [3] and traj.length == 2


def test_finishing_twice_counts_once():
    (task,) = make_tasks(1)
    run = make_running_run()
    tid = play(run, success=True)
    episodes.trajectory_finish(trajectory_id=tid, status="failed", reward=0.0)
    assert Trajectory.objects.get(pk=tid).status == "succeeded"
    assert TaskStat.objects.get(run=run, task=task).attempts == 1


def test_a_killed_workers_episode_is_aborted_with_the_reason_and_its_group_completes():
    from datetime import timedelta

    from django.utils import timezone

    from datamanager.models import EnvSlot

    make_tasks(1)
    run = make_running_run({"curation": {"n_max": 2}})
    dead = EnvSlot.objects.create(
        name="h:1:miniwob:0",
        host="h",
        backend="miniwob",
        last_heartbeat=timezone.now() - timedelta(minutes=5),
    )
    live = EnvSlot.objects.create(
        name="h:2:miniwob:1", host="h", backend="miniwob", last_heartbeat=timezone.now()
    )
    stuck = episodes.task_claim(run_id=run.pk, slot_id=dead.pk, env_kinds=("miniwob",))
    busy = episodes.task_claim(run_id=run.pk, slot_id=live.pk, env_kinds=("miniwob",))
    assert episodes.trajectories_abort_orphans(run_id=run.pk, stale_after_s=25) == 1
    aborted = Trajectory.objects.get(pk=stuck.trajectory_id)
    assert aborted.status == "aborted" and "stopped mid-episode" in aborted.error
    assert Trajectory.objects.get(pk=busy.trajectory_id).status == "running"
    episodes.trajectory_finish(trajectory_id=busy.trajectory_id, status="succeeded", reward=1.0)
    assert TaskGroup.objects.get(run=run, index=1).status == GroupStatus.READY


def test_a_worker_started_again_before_the_watchdog_looked_ends_the_cut_episode_of_its_slot():
    """The whole stack killed and started again: the new env worker revives its slot's row
    (a fresh heartbeat) before the watchdog found the old one stale. The episode the kill
    cut must still end, or its group never completes."""
    from datetime import timedelta

    from django.utils import timezone

    from datamanager.models import EnvSlot
    from datamanager.services.env_slots import env_slot_register

    make_tasks(1)
    run = make_running_run({"curation": {"n_max": 1, "n_min": 1}})
    slot = EnvSlot.objects.create(
        name="h:1:miniwob:0", host="h", backend="miniwob", last_heartbeat=timezone.now()
    )
    cut = episodes.task_claim(run_id=run.pk, slot_id=slot.pk, env_kinds=("miniwob",))
    EnvSlot.objects.filter(pk=slot.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=2))
    assert episodes.trajectories_abort_orphans(run_id=run.pk, stale_after_s=25) == 0  # fresh

    env_slot_register(name=slot.name, host="h2", backend="miniwob", run_id=run.pk)
    ended = Trajectory.objects.get(pk=cut.trajectory_id)
    assert ended.status == "aborted" and f"slot {slot.name} was taken up again on h2" in ended.error
    assert TaskGroup.objects.get(run=run, index=1).status == GroupStatus.READY


def test_an_episode_killed_between_a_step_and_its_length_is_closed_with_every_stored_step():
    """A step is stored as its row, then the trajectory's length: a worker killed between the
    two leaves a row past the length. The aborted trajectory counts every step it stored."""
    from datetime import timedelta

    from django.utils import timezone

    from datamanager.models import EnvSlot
    from tests.conftest import png_bytes

    make_tasks(1)
    run = make_running_run({})
    dead = EnvSlot.objects.create(
        name="h:1:miniwob:0", host="h", backend="miniwob", last_heartbeat=timezone.now()
    )
    claim = episodes.task_claim(run_id=run.pk, slot_id=dead.pk, env_kinds=("miniwob",))
    for index in (0, 1):
        step_record(
            trajectory_id=claim.trajectory_id, index=index, screenshot_png=png_bytes(),
            width=160, height=210, raw_output="Action: wait()", thought="",
            action={"type": "wait"}, parse_error="", prompt_tokens=3, response_tokens=2,
            rollout_logprobs=[-0.1, -0.2], mean_entropy=0.5, policy_version=0, env_ms=1.0,
            model_ms=1.0,
        )  # fmt: skip
    Trajectory.objects.filter(pk=claim.trajectory_id).update(length=1)  # the kill's lost write
    EnvSlot.objects.filter(pk=dead.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    assert episodes.trajectories_abort_orphans(run_id=run.pk, stale_after_s=25) == 1
    aborted = Trajectory.objects.get(pk=claim.trajectory_id)
    assert aborted.status == "aborted"
    assert aborted.length == Step.objects.filter(trajectory=aborted).count() == 2


def test_a_task_may_declare_its_own_step_budget():
    (task,) = make_tasks(1)
    task.env_config = {**task.env_config, "max_steps": 4}
    task.save()
    run = make_running_run({"curation": {"default_step_cap": 15, "dynamic_step_cap": False}})
    assert episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",)).step_cap == 4
    play(run, success=False)
    assert TaskStat.objects.get(run=run, task=task).step_cap == 4


def test_a_model_output_with_nul_characters_is_stored_and_the_episode_goes_on():
    """PostgreSQL refuses NUL in text and jsonb; an untrained policy's byte tokens decode to
    it. The step is stored with U+FFFD in its place (on SQLite too, so both read the same)."""
    from datamanager.models import Step, Trajectory
    from datamanager.services import episodes
    from tests.conftest import png_bytes
    from tests.datamanager.factories import make_running_run, make_tasks

    make_tasks(1)
    run = make_running_run({})
    claim = episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("miniwob",))
    step_record(
        trajectory_id=claim.trajectory_id, index=0, screenshot_png=png_bytes(), width=160,
        height=210, raw_output="Thought: \x00x\nAction: type(content='a\x00b')",
        thought="\x00x", action={"type": "type", "text": "a\x00b"}, parse_error="",
        prompt_tokens=10, response_tokens=5, rollout_logprobs=[], mean_entropy=0.5,
        policy_version=0, env_ms=1.0, model_ms=1.0,
    )  # fmt: skip
    episodes.trajectory_finish(trajectory_id=claim.trajectory_id, status="failed", reward=0.0,
                               details={"note": "\x00"})  # fmt: skip
    step = Step.objects.get(trajectory_id=claim.trajectory_id)
    assert step.raw_output == "Thought: \ufffdx\nAction: type(content='a\ufffdb')"
    assert (step.thought, step.action["text"]) == ("\ufffdx", "a\ufffdb")
    assert Trajectory.objects.get(pk=claim.trajectory_id).details == {"note": "\ufffd"}
