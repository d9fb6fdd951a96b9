"""pass@k and intervals against hand-computed values."""

import pytest

from datamanager.eval_metrics import Episode, pass_at_k, summary, task_result, wilson_interval


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k
    with pytest.raises(ValueError, match="at least 3 samples"):
        pass_at_k(2, 1, 3)


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-3) and hi == pytest.approx(0.7634, abs=1e-3)
    assert wilson_interval(0, 10)[0] == 0.0
    assert wilson_interval(10, 10)[1] == 1.0


def test_env_errors_are_reported_apart():
    eps = [
        Episode("t", "succeeded", 1.0, 3, 0),
        Episode("t", "failed", 0.0, 5, 2),
        Episode("t", "error", 0.0, 1, 0),
    ]
    r = task_result("t", eps, k=2)
    assert r.episodes == 2 and r.env_errors == 1 and r.success_rate == 0.5
    assert r.pass_at_k == 1.0 and r.mean_steps_of_successes == 3
    assert r.parse_error_rate == pytest.approx(2 / 8)
    s = summary([r])
    assert s["episodes"] == 2 and s["env_errors"] == 1
