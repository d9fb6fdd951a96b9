"""Evaluation pages as a researcher uses them: the job list, one job's per-task report, the
task x policy matrix, a comparison of two jobs, and the episodes behind every number.

Jobs and their episodes are real rows; finished jobs carry the report the harness writes
(`datamanager.selectors.evaluations.eval_report`)."""

from __future__ import annotations

import json
import re

import pytest
from django.test import Client
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.eval_metrics import wilson_interval
from datamanager.models import EvalJob, EvalStatus, Purpose, Run, Step, Task, Trajectory
from datamanager.selectors.evaluations import eval_report
from datamanager.services.runs import run_create

pytestmark = pytest.mark.django_db

# One name is a prefix of the other, as in MiniWoB: links must not mix their episodes.
BUTTON, SEQUENCE, TEXT = "click-button", "click-button-sequence", "enter-text"

OUTCOME = {"S": "succeeded", "F": "failed", "E": "error", "R": "running"}


def task(name: str) -> Task:
    return Task.objects.get_or_create(
        name=name, defaults={"env_kind": "miniwob", "instruction": name, "split": "eval"}
    )[0]


def make_run(name: str) -> Run:
    return run_create(name=name, config=RunConfig.from_dict({}))


def make_job(
    name: str,
    tasks: list[str],
    *,
    run: Run | None = None,
    version: int | None = None,
    k: int = 4,
    greedy: bool = True,
    status: str = EvalStatus.RUNNING,
) -> EvalJob:
    return EvalJob.objects.create(
        name=name,
        policy=f"run:{run.pk}:v{version}" if run else "oracle",
        run=run,
        policy_version=version,
        task_names=[task(t).name for t in tasks],
        k=k,
        greedy=greedy,
        temperature=0.0 if greedy else 0.7,
        status=status,
        total=len(tasks) * k,
    )


def play(job: EvalJob, name: str, outcomes: str, *, steps=(), parse_errors=()) -> list[int]:
    """Episodes of `job` on task `name`: S succeeded, F failed, E env error, R running.

    steps[i] steps (default 2) of which the first parse_errors[i] failed to parse."""
    ids = []
    for i, code in enumerate(outcomes):
        n = steps[i] if i < len(steps) else 2
        status = OUTCOME[code]
        traj = Trajectory.objects.create(
            task=task(name),
            run=job.run,
            purpose=Purpose.EVAL,
            eval_job=job,
            seed=job.seed * 1000 + i,
            status=status,
            reward={"S": 1.0, "F": 0.0}.get(code),
            length=n,
            finished_at=None if code == "R" else timezone.now(),
            error="browser crashed" if code == "E" else "",
        )
        bad = parse_errors[i] if i < len(parse_errors) else 0
        Step.objects.bulk_create(
            Step(trajectory=traj, index=s, parse_error="no action" if s < bad else "")
            for s in range(n)
        )
        ids.append(traj.pk)
    done = Trajectory.objects.filter(eval_job=job).exclude(status="running").count()
    EvalJob.objects.filter(pk=job.pk).update(done=done)
    return ids


def finish(job: EvalJob) -> EvalJob:
    """What the harness does after the last episode: write the report."""
    EvalJob.objects.filter(pk=job.pk).update(
        status=EvalStatus.FINISHED, report=eval_report(job_id=job.pk), finished_at=timezone.now()
    )
    job.refresh_from_db()
    return job


def pct(x: float) -> str:
    return f"{round(x * 100)}%"


def row(html: str, attr: str, value: object) -> str:
    m = re.search(rf'<tr {attr}="{re.escape(str(value))}"[^>]*>.*?</tr>', html, re.S)
    assert m, f"no row with {attr}={value}"
    return m.group(0)


def cell(html: str, cls: str) -> str:
    m = re.search(rf'<td class="[^"]*\b{cls}\b[^"]*"[^>]*>(.*?)</td>', html, re.S)
    assert m, f"no cell {cls}"
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", m.group(1))).strip()


def listed_trajectories(client: Client, url: str) -> set[int]:
    html = client.get(url).content.decode()
    table = re.search(r'<table id="trajectories">.*?</table>', html, re.S).group(0)
    return {int(i) for i in re.findall(r'href="/trajectories/(\d+)/"', table)}


# --- permissions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "/evaluations/",
        "/evaluations/1/",
        "/evaluations/matrix/",
        "/evaluations/matrix/?run=1",
        "/evaluations/compare/?a=1&b=2",
    ],
)
def test_anonymous_is_sent_to_login(client, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=")


def test_navigation_and_run_page_link_to_evaluations(ada_client):
    run = make_run("grpo-1")
    assert 'href="/evaluations/"' in ada_client.get("/").content.decode()
    page = ada_client.get(f"/runs/{run.pk}/").content.decode()
    assert f'href="/evaluations/matrix/?run={run.pk}"' in page


# --- list --------------------------------------------------------------------------------


def test_list_shows_progress_success_rate_and_errors(ada_client):
    run = make_run("grpo-1")
    done = make_job("nightly", [BUTTON, TEXT], run=run, version=3, k=4)
    play(done, BUTTON, "SSSF")
    play(done, TEXT, "SFFE")  # the env error is not a policy failure: 4/7
    finish(done)
    running = make_job("sampled check", [BUTTON, TEXT], k=4, greedy=False)
    play(running, BUTTON, "SSFE")  # 2 of 3 scored so far
    play(running, TEXT, "R")
    broken = make_job("broken", [TEXT], k=2, status=EvalStatus.FAILED)
    EvalJob.objects.filter(pk=broken.pk).update(error="EvalSetupError: server failed to start")

    html = ada_client.get("/evaluations/").content.decode()
    order = [int(i) for i in re.findall(r'<tr data-job="(\d+)"', html)]
    assert order == [broken.pk, running.pk, done.pk]  # newest first

    r = row(html, "data-job", done.pk)
    assert "nightly" in r and f'href="/runs/{run.pk}/"' in r and "grpo-1" in r and "v3" in r
    assert cell(r, "progress") == "100% 8/8" and '<progress value="8" max="8">' in r
    assert cell(r, "rate") == pct(4 / 7)  # the report's pooled rate
    assert "greedy" in r and "finished" in r

    r = row(html, "data-job", running.pk)
    assert cell(r, "progress") == "50% 4/8" and '<progress value="4" max="8">' in r
    assert cell(r, "rate") == f"{pct(2 / 3)} so far"  # counted from finished episodes
    assert "sampled (T=0.7)" in r

    r = row(html, "data-job", broken.pk)
    assert "EvalSetupError: server failed to start" in r and cell(r, "rate") == "—"


def test_list_filters_by_run_and_pages(ada_client):
    run, other = make_run("grpo-1"), make_run("grpo-2")
    for v in range(51):
        make_job(f"v{v}", [BUTTON], run=run, version=v)
    mine = make_job("other run", [BUTTON], run=other, version=1)
    page = ada_client.get("/evaluations/").content.decode()
    assert "52 evaluation jobs" in page and "page 1 of 2" in page
    assert len(re.findall(r'<tr data-job="', page)) == 50
    page = ada_client.get(f"/evaluations/?run={other.pk}").content.decode()
    assert "1 evaluation jobs" in page
    assert re.findall(r'<tr data-job="(\d+)"', page) == [str(mine.pk)]
    assert ada_client.get("/evaluations/?run=x").status_code == 400


# --- detail ------------------------------------------------------------------------------


def test_detail_table_numbers_and_links_to_episodes(ada_client):
    job = make_job("nightly", [BUTTON, SEQUENCE, TEXT], k=4)
    button = play(job, BUTTON, "SSEF", steps=(3, 5, 1, 6), parse_errors=(0, 1, 0, 2))
    play(job, SEQUENCE, "SFFF", steps=(2, 7, 7, 7))
    other = make_job("other", [BUTTON])
    play(other, BUTTON, "SS")
    finish(job)

    html = ada_client.get(f"/evaluations/{job.pk}/").content.decode()
    assert "No report yet" not in html
    r = row(html, "data-task", BUTTON)
    lo, hi = wilson_interval(2, 3)
    assert cell(r, "num") == "2/3"
    assert cell(r, "rate") == pct(2 / 3)
    assert cell(r, "ci") == f"{round(lo * 100)}–{pct(hi)}"
    assert cell(r, "reward") == "0.67"
    assert cell(r, "pass1") == pct(2 / 3)
    assert cell(r, "passk") == "100%"  # pass@min(k, n) with 2 of 3 successes
    assert cell(r, "steps") == "4.0"  # (3 + 5) / 2: successes only
    assert cell(r, "parse") == pct(3 / 14)  # over the scored episodes' steps
    assert cell(r, "errors") == "1"

    r = row(html, "data-task", SEQUENCE)
    lo, hi = wilson_interval(1, 4)
    assert cell(r, "rate") == "25%" and cell(r, "ci") == f"{round(lo * 100)}–{pct(hi)}"
    assert cell(r, "reward") == "0.25" and cell(r, "steps") == "2.0"
    assert cell(r, "parse") == "0%" and cell(r, "errors") == "0"
    assert "no finished episode yet" in row(html, "data-task", TEXT)

    link = f"/trajectories/?eval_job={job.pk}&task={BUTTON}&task_exact=1"
    assert f'href="{link}"' in html
    # Only this job's episodes of this task: not the other job's, not click-button-sequence.
    assert listed_trajectories(ada_client, link) == set(button)


def test_detail_of_a_running_job_counts_finished_episodes(ada_client):
    job = make_job("live", [BUTTON], k=4)
    play(job, BUTTON, "SFFR")
    html = ada_client.get(f"/evaluations/{job.pk}/").content.decode()
    assert "No report yet" in html
    assert cell(row(html, "data-task", BUTTON), "rate") == pct(1 / 3)
    assert ada_client.get("/evaluations/999999/").status_code == 404


def test_an_episode_played_again_after_a_crash_counts_once_and_by_its_score():
    """A worker killed mid-episode leaves it `aborted`; should the resumed shard play it
    again, the job has two trajectories for one episode. It counts once, as the scored
    one, and the job is not done before its last episode ends."""
    from datamanager.selectors.evaluations import eval_job_done, eval_shard_finished
    from datamanager.services.evaluations import eval_job_finish_if_done

    job = make_job("resumed", [BUTTON], k=2)
    job.shards = 1
    job.save(update_fields=["shards"])
    cut, running = play(job, BUTTON, "FR")
    Trajectory.objects.filter(pk=cut).update(status="aborted", reward=None)
    again = Trajectory.objects.get(pk=cut)
    again.pk = None
    again.status, again.reward = "succeeded", 1.0
    again.save()  # the same episode (task, seed), played again
    assert eval_job_done(job_id=job.pk) == 1
    assert not eval_shard_finished(job=job, shard=0)
    assert eval_job_finish_if_done(job_id=job.pk).status == EvalStatus.RUNNING
    Trajectory.objects.filter(pk=running).update(status="failed", reward=0.0)
    finished = eval_job_finish_if_done(job_id=job.pk)
    assert finished.status == EvalStatus.FINISHED and finished.done == 2
    [result] = finished.report["tasks"]
    assert (result["episodes"], result["successes"]) == (2, 1)


def test_a_resumed_shard_ends_the_episodes_its_dead_worker_left_running():
    """The whole stack killed and started again: the shard resumes before the watchdog found
    its cut episode old enough to end. The shard holds the lease of its tasks' episodes, so
    one still running there was cut: it ends `aborted`, and the shard's other work stays."""
    from datamanager.services.evaluations import eval_episodes_cut_end

    job = make_job("cut", [BUTTON, SEQUENCE], k=2)
    [done, cut] = play(job, BUTTON, "SR")
    [elsewhere] = play(job, SEQUENCE, "R")  # another shard's episode, under way
    assert eval_episodes_cut_end(job_id=job.pk, task_names=[BUTTON], where="shard 1/2 on h2") == 1
    ended = Trajectory.objects.get(pk=cut)
    assert ended.status == "aborted" and "shard 1/2 on h2 resumed it" in ended.error
    assert Trajectory.objects.get(pk=done).status == "succeeded"
    assert Trajectory.objects.get(pk=elsewhere).status == "running"


# --- matrix ------------------------------------------------------------------------------


def test_matrix_puts_each_rate_in_its_cell_and_links_to_the_episodes(ada_client):
    run, other = make_run("grpo-1"), make_run("grpo-2")
    v2 = make_job("grpo-1 v2", [BUTTON, SEQUENCE], run=run, version=2)
    v2_button = play(v2, BUTTON, "SSSFER")  # running and env error out of the denominator
    play(v2, SEQUENCE, "FFFF")
    finish(v2)
    v1 = make_job("grpo-1 v1", [BUTTON], run=run, version=1)
    play(v1, BUTTON, "SFFF")
    finish(v1)
    unfinished = make_job("grpo-1 v3", [BUTTON], run=run, version=3)
    play(unfinished, BUTTON, "SSSS")
    elsewhere = make_job("grpo-2 v1", [BUTTON, TEXT], run=other, version=1)
    play(elsewhere, TEXT, "SS")
    finish(elsewhere)

    html = ada_client.get(f"/evaluations/matrix/?run={run.pk}").content.decode()
    columns = re.findall(r'<th data-job="(\d+)"', html)
    assert columns == [str(v1.pk), str(v2.pk)]  # by policy version; only finished jobs
    r = row(html, "data-task", BUTTON)
    cells = dict(re.findall(r'<td class="cell" data-job="(\d+)"[^>]*>(.*?)</td>', r, re.S))
    assert re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", cells[str(v2.pk)])).strip() == "75% 3/4"
    assert re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", cells[str(v1.pk)])).strip() == "25% 1/4"
    r = row(html, "data-task", SEQUENCE)
    assert "0/4" in r and 'title="not evaluated"' in r  # v1 did not evaluate it
    assert TEXT not in html  # another run's task

    figure = json.loads(
        re.search(r'<script id="eval-heatmap-figure"[^>]*>(.*?)</script>', html, re.S).group(1)
    )
    heat = figure["data"][0]
    assert heat["type"] == "heatmap" and heat["y"] == [BUTTON, SEQUENCE]
    assert heat["x"] == [f"grpo-1 v1 #{v1.pk}", f"grpo-1 v2 #{v2.pk}"]
    assert heat["z"] == [[0.25, 0.75], [None, 0.0]]
    assert "/vendor/plotly.min.js" in html

    link = f"/trajectories/?eval_job={v2.pk}&task={BUTTON}&task_exact=1"
    assert f'href="{link}"' in cells[str(v2.pk)]
    assert listed_trajectories(ada_client, link) == set(v2_button)

    # Across runs: the latest finished jobs of every run, oldest first.
    html = ada_client.get("/evaluations/matrix/").content.decode()
    assert re.findall(r'<th data-job="(\d+)"', html) == [str(v2.pk), str(v1.pk), str(elsewhere.pk)]
    text = row(html, "data-task", TEXT)
    assert re.search(rf'data-job="{elsewhere.pk}"[^>]*>\s*<a [^>]*>100%</a>', text)


def test_matrix_across_runs_shows_the_twelve_latest_jobs(ada_client):
    jobs = [finish(make_job(f"job {i}", [BUTTON])) for i in range(13)]
    html = ada_client.get("/evaluations/matrix/").content.decode()
    assert re.findall(r'<th data-job="(\d+)"', html) == [str(j.pk) for j in jobs[1:]]
    empty = ada_client.get(f"/evaluations/matrix/?run={make_run('new').pk}").content.decode()
    assert "No finished evaluation jobs for this run yet." in empty


# --- compare -----------------------------------------------------------------------------


def test_compare_lists_differing_tasks_first(ada_client):
    a = make_job("v1", [BUTTON, SEQUENCE, TEXT])
    play(a, BUTTON, "SSFF")
    play(a, SEQUENCE, "SSSS")
    play(a, TEXT, "SFFF")
    b = make_job("v2", [BUTTON, SEQUENCE, TEXT])
    play(b, BUTTON, "SSFFE")  # the same rate: the env error does not count
    play(b, SEQUENCE, "SSSF")
    play(b, TEXT, "SSSF")
    html = ada_client.get(f"/evaluations/compare/?a={a.pk}&b={b.pk}").content.decode()
    table = re.search(r'<table id="eval-compare">.*?</table>', html, re.S).group(0)
    assert re.findall(r'<tr data-task="([^"]+)"', table) == [TEXT, SEQUENCE, BUTTON]
    assert 'class="differs"' in row(table, "data-task", TEXT)
    assert 'class="differs"' in row(table, "data-task", SEQUENCE)
    assert 'class="differs"' not in row(table, "data-task", BUTTON)
    text = row(table, "data-task", TEXT)
    assert cell(text, "a") == "25% 1/4" and cell(text, "b") == "75% 3/4"
    assert cell(text, "diff") == "+50 pp"
    assert cell(row(table, "data-task", SEQUENCE), "diff") == "-25 pp"
    assert cell(row(table, "data-task", BUTTON), "diff") == "0 pp"
    assert "2</b><span>of 3 tasks differ" in html


@pytest.mark.parametrize(
    ("query", "status", "message"),
    [
        ("", 200, "Choose two evaluation jobs"),
        ("?a={a}", 400, "b: This field is required."),
        ("?a=abc&b={a}", 400, "a: Enter a whole number."),
        ("?a={a}&b=0", 400, "b: Ensure this value is greater than or equal to 1."),
        ("?a={a}&b=999999", 404, "there is no evaluation job #999999"),
        ("?a=999998&b=999999", 404, "no evaluation job #999998, #999999"),
    ],
)
def test_compare_explains_bad_ids(ada_client, query, status, message):
    a = make_job("v1", [BUTTON])
    response = ada_client.get("/evaluations/compare/" + query.format(a=a.pk))
    assert response.status_code == status
    problem = re.search(r'id="problem">(.*?)</div>', response.content.decode(), re.S)
    assert problem and message in problem.group(1)
    assert 'id="eval-compare"' not in response.content.decode()
