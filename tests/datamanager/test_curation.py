"""Each curation rule, pinned against the paper's numbers and hand-checked cases."""

import pytest

from datamanager.curation import (
    Candidate,
    is_stale,
    pick_task,
    pool_fill_count,
    rolling_success_rate,
    rollout_budget,
    step_cap,
)


@pytest.mark.parametrize(("s", "n"), [(0.7, 5), (0.8, 4), (0.9, 3), (1.0, 2), (0.6, 8), (0.65, 6)])
def test_dart_budget_rule(s, n):
    assert rollout_budget(success_rate=s, n_max=8, n_min=2, threshold=0.6, dynamic=True) == n


def test_budget_below_threshold_or_unknown_or_off_is_n_max():
    kw = {"n_max": 8, "n_min": 2, "threshold": 0.6}
    assert rollout_budget(success_rate=0.3, dynamic=True, **kw) == 8
    assert rollout_budget(success_rate=None, dynamic=True, **kw) == 8
    assert rollout_budget(success_rate=1.0, dynamic=False, **kw) == 8


def test_budget_never_below_n_min():
    assert rollout_budget(success_rate=1.0, n_max=8, n_min=3, threshold=0.6, dynamic=True) == 3


def test_step_cap_follows_longest_success():
    assert step_cap(longest_success=4, default_cap=15, margin=2, dynamic=True) == 6
    assert step_cap(longest_success=None, default_cap=15, margin=2, dynamic=True) == 15
    assert step_cap(longest_success=4, default_cap=15, margin=2, dynamic=False) == 15


def test_rolling_success_rate_uses_the_window():
    assert rolling_success_rate([True, False, False, True], window=2) == 0.5
    assert rolling_success_rate([True, True, False], window=10) == pytest.approx(2 / 3)
    assert rolling_success_rate([], window=4) is None


def test_pick_task_fills_one_group_after_another_and_respects_boost_and_retire():
    """Slots claiming in turn finish a task's group before starting the next, so each group
    is ready for the trainer within its own few episodes."""
    left = {1: 4, 2: 4, 3: 2}
    order = []
    while (task := pick_task([Candidate(t, n) for t, n in left.items()])) is not None:
        order.append(task)
        left[task] -= 1
    assert order == [3, 3, 1, 1, 1, 1, 2, 2, 2, 2]
    assert pick_task([Candidate(1, 2), Candidate(2, 5, boost=4.0)]) == 2  # 5 / 4 < 2
    assert pick_task([Candidate(1, 0), Candidate(2, 3, boost=0.0)]) is None


def test_pool_fill_only_for_all_failed_groups():
    kw = {"group_size": 8, "pool_size": 5, "ratio": 0.25, "enabled": True}
    assert pool_fill_count(all_failed=True, **kw) == 2
    assert pool_fill_count(all_failed=False, **kw) == 0
    assert pool_fill_count(all_failed=True, **{**kw, "enabled": False}) == 0
    assert pool_fill_count(all_failed=True, **{**kw, "pool_size": 1}) == 1
    assert pool_fill_count(all_failed=True, **{**kw, "group_size": 2}) == 1


def test_staleness_window():
    assert is_stale(step_version=3, current_version=6, k=2)
    assert not is_stale(step_version=4, current_version=6, k=2)
    assert not is_stale(step_version=None, current_version=6, k=0)
