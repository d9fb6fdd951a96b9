"""The review views in a real chromium against the web server: open a GRPO group from a point
of the groups chart, compare two checkpoints' episodes, filter the trajectory list by a reward
bin, and label three failures with the keyboard, then see a real update of the tiny policy
leave them out."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from tests.dartboard.test_browser import _log_in_as_ada, in_thread, page, running_web  # noqa: F401
from tests.datamanager.factories import make_running_run, make_tasks, play

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def dashboard(subprocess_env, researcher, page):  # noqa: F811
    """(page, url): Ada signed in to the web server serving the test database."""
    with running_web(subprocess_env) as url:
        _log_in_as_ada(page, url, researcher)
        page.wait_for_selector("text=Log out")
        yield page, url


def _groups_of_three(config: dict | None = None):
    """Two tasks, groups of three: each a success and two failures (six episodes; the
    groups fill one after another). `ids`: the two successes first, then the failures."""
    make_tasks(2)
    run = make_running_run(
        {"curation": {"n_max": 3, "n_min": 3, "entropy_top_q": 1.0}, **(config or {})}
    )
    played = [(s, play(run, success=s, steps=2)) for s in (True, False, False, True, False, False)]
    return run, [i for s, i in played if s] + [i for s, i in played if not s]


def test_a_point_of_the_groups_chart_opens_the_group(dashboard):
    from datamanager.models import TaskGroup

    tab, url = dashboard
    run, _ = in_thread(_groups_of_three)
    tab.goto(f"{url}/runs/{run.pk}/")
    tab.wait_for_selector("#charts[data-loaded='1']", state="attached")
    points = tab.locator("#chart-groups path.point")
    assert points.count() == 2
    # The chart may still resize (responsive layout) or redraw after a live event: aim at
    # the point where it is now, and again if the first click met it mid-redraw. A click
    # that hit asks for the group's page at once; the page may take long to come on a
    # loaded machine, and the chart is gone once it has.
    group_page = re.compile(r".*/groups/\d+/$")
    tab.locator("#chart-groups").scroll_into_view_if_needed()  # a mouse click needs it in view
    for _ in range(3):
        box = points.first.bounding_box()
        try:
            with tab.expect_request(group_page, timeout=5000):
                tab.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
                tab.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            break
        except PlaywrightTimeout:
            tab.wait_for_timeout(500)
    tab.wait_for_url(group_page, timeout=60_000)
    group_id = int(tab.url.rstrip("/").rsplit("/", 1)[1])
    group = in_thread(TaskGroup.objects.get, pk=group_id)
    assert group.run_id == run.pk
    assert tab.locator("#group-lanes .lane").count() == 3
    assert tab.locator("#group-lanes .lane .frame").count() == 6  # two steps each, side by side


def test_two_checkpoints_episodes_are_compared_with_the_divergence_marked(dashboard):
    from datamanager.models import EvalJob
    from tests.dartboard.test_review_views import _eval_episode

    tab, url = dashboard

    def jobs():
        (task,) = make_tasks(1)
        a = EvalJob.objects.create(name="v0", policy="run:1:v0", task_names=[task.name], k=1)
        b = EvalJob.objects.create(name="v4", policy="run:1:v4", task_names=[task.name], k=1)
        same, other = {"type": "click", "x": 40, "y": 60}, {"type": "type", "text": "ok"}
        _eval_episode(a, task, 3, [same, same, same], False)
        _eval_episode(b, task, 3, [same, other, {"type": "finished"}], True)
        return a, b

    a, b = in_thread(jobs)
    tab.goto(f"{url}/evaluations/compare/?a={a.pk}&b={b.pk}")
    tab.click(".episode-link >> text=3")
    tab.wait_for_selector("#divergence >> text=step 1")
    for side in ("A", "B"):
        marked = tab.locator(f"#diverge-{side} .frame")
        assert marked.get_attribute("data-step") == "1" and marked.is_visible()
    assert tab.locator(".lane[data-side='B'] .frame").count() == 3


def test_a_reward_bin_filters_the_trajectory_list(dashboard):
    from datamanager.models import Trajectory

    tab, url = dashboard
    run, ids = in_thread(_groups_of_three)
    tab.goto(f"{url}/trajectories/?run={run.pk}")
    tab.click("#reward-histogram a[data-bin='1']")
    tab.wait_for_url(re.compile(r".*reward_min=1.*"))
    shown = [int(x) for x in tab.locator("#trajectories tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.trajectory)")]  # fmt: skip
    rewards = in_thread(lambda: {t.reward for t in Trajectory.objects.filter(pk__in=shown)})
    assert sorted(shown) == sorted(ids[:2]) and rewards == {1.0}
    assert tab.locator("#reward-histogram a.selected").get_attribute("data-bin") == "1"


def test_three_failures_labelled_by_keyboard_are_left_out_of_the_next_update(
    dashboard, tiny_policy_dir, settings, tmp_path
):
    from datamanager.models import FailureLabel, Step
    from workers import training_loop

    tab, url = dashboard
    settings.CHECKPOINT_ROOT = tmp_path / "checkpoints"
    run, ids = in_thread(
        _groups_of_three,
        {"policy": str(tiny_policy_dir),
         "trainer": {"min_groups": 2, "lr": 1e-3, "kl_coef": 0.0, "max_updates": 1}},
    )  # fmt: skip
    tab.goto(f"{url}/runs/{run.pk}/labels/")
    labelled = []
    for i in range(3):
        form = tab.locator("#label-form")
        labelled.append(int(form.get_attribute("data-trajectory")))
        if i == 0:
            tab.keyboard.press("c")
            tab.keyboard.type("the page never loaded")
            tab.keyboard.press("Escape")
        tab.keyboard.press("e")
        tab.wait_for_selector(f"text=Trajectory {labelled[-1]}: environment bug.")
    assert tab.locator("#queue-count").text_content().startswith("1 unlabelled")
    assert set(labelled) < set(ids[2:])
    labels = in_thread(
        lambda: list(FailureLabel.objects.select_related("user").order_by("created_at"))
    )
    assert [lab.trajectory_id for lab in labels] == labelled
    assert labels[0].comment == "the page never loaded" and labels[0].user.username == "ada"

    training_loop.trainers_forget_all()
    assert (
        in_thread(training_loop.train_for, run_id=run.pk, max_seconds=120) == "max_updates reached"
    )
    trained = in_thread(lambda: set(
        Step.objects.filter(trajectory__run=run, trained_in_update__isnull=False)
        .values_list("trajectory_id", flat=True)))  # fmt: skip
    assert trained == set(ids) - set(labelled)
    tab.goto(f"{url}/runs/{run.pk}/tasks/")
    counts = tab.locator("#task-board [data-label='env_bug']").all_text_contents()
    assert sorted(int(c.split()[0]) for c in counts) == [1, 2]
