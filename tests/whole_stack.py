"""The whole `make run` stack crashed at once, and what it must come back with.

Used by tests/dartboard/test_whole_stack_crash.py and bench/chaos.py. The launcher is
`manage.py run_dartboard` (what `make run` runs) with its host agent, started in a session
of its own on a DARTBOARD_HOME; a crash SIGKILLs it and every process it started, all at
once: the web, the default Celery worker, beat, the embedded Redis and the run's own
processes (env workers with their chromium, the trainer, the inference worker, the router).
It is then started again on the same home, and `recovery_problems` reads the database and
the media directory the stack wrote:

    stack = CrashStack(home=home, env=env)
    stack.start()
    cut = stack.crash_when(lambda: update_under_way(run.pk), run_id=run.pk, timeout=120,
                           what="an update")    # what was under way, and what it cut
    restarted, back_s = stack.come_back(cut, timeout=120)
    assert recovery_problems(cut, media_root=home / "media", restarted=restarted) == {}

The launcher runs as `make run ARGS="--shell-only --env-slots 0"`: everything `make run`
starts but its preset's run (whose start collects oracle demonstrations and whose every
version is evaluated on 60 episodes); the run here is a tiny one, started as a user starts
one (`crash_run_create`, before the first start), and the same host agent places it and
brings its processes back. Django must be set up on the stack's database before anything
here reads it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from django.db import connection, transaction
from django.utils import timezone

from datamanager.config import RunConfig
from datamanager.models import (
    EvalJob,
    EvalStatus,
    GroupStatus,
    PolicyVersion,
    Purpose,
    Run,
    Step,
    TaskGroup,
    TrainUpdate,
    Trajectory,
    TrajectoryStatus,
)
from datamanager.services.run_workers import run_apply
from datamanager.services.runs import run_create
from tests.helpers import free_port
from tests.live_stack import fault_run_config

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# What the trainer says on its run while an update is under way (workers/training_loop.py).
TRAINING_MESSAGE = "training on "
UNDER_WAY = (EvalStatus.QUEUED, EvalStatus.RUNNING)

CHECKS = {
    "running": "no trajectory left running",
    "contiguous": "versions and steps contiguous",
    "screenshots": "screenshots on disk",
    "evaluation": "killed evaluation finished",
    "groups": "no group stuck",
}


def crash_run_create(name: str = "whole-stack crash") -> Run:
    """A started run the launcher's host agent places (DARTBOARD_PROCESSES=per-run):
    `fault_run_config` (three easy MiniWoB++ tasks on two chromium slots, the shipped tiny
    policy, an update per ready group) with groups of two, episodes of at most 5 steps, and
    every version evaluated greedily on one held-out seed per task (3 episodes on one slot)."""
    cfg = fault_run_config().to_dict()
    cfg["curation"].update(n_max=2, n_min=2, default_step_cap=5)
    cfg["evaluation"].update(every_n_versions=1, eval_split=False, heldout_k=1)
    run = run_create(name=name, config=RunConfig.from_dict(cfg))
    return run_apply(run_id=run.pk, action="start")


@dataclass
class Cut:
    """What a crash cut, read from the database once every process was dead."""

    run_id: int
    at: datetime
    moment: str  # "update", "evaluation", "update + evaluation" or "collecting"
    running: list[int]  # trajectories under way
    eval_jobs: list[int]  # evaluations queued or under way
    killed: list[int] = field(default_factory=list)  # pids


class CrashStack:
    """The launcher on `home` with `env` (the database's URL among them), started and crashed
    as often as asked. Its output goes to `home`/launcher.log; the ports stay the same
    across restarts, as a user's would."""

    def __init__(self, *, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.env = {**env, "DARTBOARD_HOME": str(home), "DARTBOARD_PROCESSES": "per-run"}
        self.env.pop("REDIS_URL", None)  # the embedded Redis: part of the stack it kills
        self.port = free_port()
        self.router_port = free_port()  # the host agent places runs from here up
        self.launcher: subprocess.Popen[bytes] | None = None

    def start(self) -> datetime:
        """Start the launcher; returns when."""
        self.home.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "manage.py", "run_dartboard", "--shell-only", "--env-slots", "0",
                "--port", str(self.port), "--router-port", str(self.router_port)]  # fmt: skip
        with (self.home / "launcher.log").open("ab") as log:
            # A session of its own: what it started stays findable after it dies (`crash`).
            self.launcher = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        return timezone.now()

    def crash(self, run_id: int, *, tree: set[psutil.Process] | None = None) -> Cut:
        """SIGKILL the launcher and everything it started (`tree`, if read already), then
        read what that cut."""
        assert self.launcher is not None
        killed = tree_kill(self.launcher, tree=tree)
        self.launcher = None
        cut = cut_read(run_id)
        cut.killed = killed
        return cut

    def crash_when(self, pred: Callable[[], bool], *, run_id: int, timeout: float,
                   what: str) -> Cut:  # fmt: skip
        """Crash the stack the moment `pred` holds. The process tree is stopped (SIGSTOP)
        while `pred` is checked and killed stopped when it holds, so the kill cuts what the
        check saw: an update that commits in the milliseconds between them is not cut."""

        def tree_if_ready() -> set[psutil.Process] | None:
            assert self.launcher is not None
            tree = tree_read(self.launcher)
            for proc in tree:
                _signal(proc, signal.SIGSTOP)
            ready = False
            try:
                ready = pred()
            finally:
                if not ready:
                    for proc in tree:
                        _signal(proc, signal.SIGCONT)
            return tree if ready else None

        return self.crash(run_id, tree=self.wait(tree_if_ready, timeout=timeout, what=what))

    def come_back(self, cut: Cut, *, timeout: float) -> tuple[datetime, float]:
        """Start the launcher again after `cut`, wait until the run collects again and every
        episode and evaluation the crash cut has ended. Returns when it was started, and the
        seconds from then until a new training episode's first step."""
        launched = time.monotonic()
        restarted = self.start()
        self.wait(lambda: collecting_since(cut.run_id, restarted), timeout=timeout,
                  what="a training episode recording steps after the restart")  # fmt: skip
        back_s = time.monotonic() - launched
        self.wait(lambda: cut_closed(cut), timeout=timeout,
                  what=f"the episodes {cut.running} and evaluations {cut.eval_jobs} to end")  # fmt: skip
        return restarted, back_s

    def stop(self) -> None:
        """The end of a test or a bench: the same kill (a stop would only take longer)."""
        if self.launcher is not None:
            tree_kill(self.launcher)
            self.launcher = None

    def wait(self, pred: Callable[[], Any], *, timeout: float, what: str) -> Any:
        """Poll `pred` every 0.2 s; an AssertionError naming `what` and the launcher's log
        after `timeout` s, or at once if the launcher exited."""
        deadline = time.monotonic() + timeout
        while True:
            value = pred()
            if value:
                return value
            if self.launcher is not None and self.launcher.poll() is not None:
                raise AssertionError(f"the launcher exited with {self.launcher.returncode} "
                                     f"while waiting for {what}:\n{self.log_tail()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what} (logs: "
                    f"{self.home / 'logs'}):\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        path = self.home / "launcher.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def tree_read(launcher: subprocess.Popen[bytes]) -> set[psutil.Process]:
    """The launcher and every process whose parent chain leads to it."""
    root = psutil.Process(launcher.pid)
    return {root, *root.children(recursive=True)}


def tree_kill(
    launcher: subprocess.Popen[bytes], *, tree: set[psutil.Process] | None = None
) -> list[int]:
    """SIGKILL the launcher and every process whose parent chain leads to it (`tree`, read
    now if not given) all at once, then every process still in its session (one forked
    after the tree was read); wait until none is left. Returns the pids killed. Only for a
    launcher started with `start_new_session`: its session is its own, so nothing else is
    ever signalled (psutil refuses a pid reused since it was read)."""
    session = launcher.pid
    victims = set(tree) if tree is not None else tree_read(launcher)
    for proc in victims:
        _signal(proc, signal.SIGKILL)
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 15
    while strays := _in_session(session) - victims:
        for proc in strays:
            _signal(proc, signal.SIGKILL)
        victims |= strays
        assert time.monotonic() < deadline, f"processes keep appearing in session {session}"
    _, alive = psutil.wait_procs(list(victims), timeout=15)
    alive = [p for p in alive if _alive(p)]
    assert not alive, f"survived SIGKILL: {[(p.pid, _cmdline(p)) for p in alive]}"
    return sorted(p.pid for p in victims)


def _in_session(session: int) -> set[psutil.Process]:
    found = set()
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session and _alive(proc):
                found.add(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _signal(proc: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(sig)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:200]
    except psutil.Error:
        return "?"


# ---------------------------------------------------------------------------- moments


def update_under_way(run_id: int) -> bool:
    """The trainer said it is training and has not recorded the update since."""
    run = Run.objects.get(pk=run_id)
    if not run.status_message.startswith(TRAINING_MESSAGE):
        return False
    return not TrainUpdate.objects.filter(run_id=run_id, created_at__gte=run.updated_at).exists()


def eval_last_episode_under_way(run_id: int) -> bool:
    """The last episode of one of the run's evaluations is running: the others have ended."""
    running = Trajectory.objects.filter(
        run_id=run_id, purpose=Purpose.EVAL, status=TrajectoryStatus.RUNNING
    )
    for job_id in running.values_list("eval_job", flat=True):
        job = EvalJob.objects.get(pk=job_id)
        ended = job.trajectories.exclude(status=TrajectoryStatus.RUNNING).count()
        if ended == job.total - 1:
            return True
    return False


def evaluation_under_way(run_id: int) -> bool:
    """A scheduled evaluation of the run has started (between episodes too)."""
    return EvalJob.objects.filter(run_id=run_id, status=EvalStatus.RUNNING).exists()


def moment_of(run_id: int) -> str:
    """What the run was doing: "update", "evaluation", both, or only "collecting"."""
    doing = {"update": update_under_way(run_id), "evaluation": evaluation_under_way(run_id)}
    return " + ".join(name for name, under_way in doing.items() if under_way) or "collecting"


def cut_read(run_id: int) -> Cut:
    """Read what the crash cut (call once every process is dead: nothing writes any more)."""
    running = Trajectory.objects.filter(run_id=run_id, status=TrajectoryStatus.RUNNING)
    return Cut(
        run_id=run_id,
        at=timezone.now(),
        moment=moment_of(run_id),
        running=sorted(running.values_list("pk", flat=True)),
        eval_jobs=sorted(
            EvalJob.objects.filter(run_id=run_id, status__in=UNDER_WAY).values_list("pk", flat=True)
        ),
    )


def collecting_since(run_id: int, since: datetime) -> bool:
    """A training episode started after `since` has recorded a step."""
    return Step.objects.filter(
        trajectory__run_id=run_id,
        trajectory__purpose=Purpose.TRAIN,
        trajectory__started_at__gt=since,
    ).exists()


def cut_closed(cut: Cut) -> bool:
    """Every episode the crash cut has ended, and every evaluation it cut has ended."""
    if Trajectory.objects.filter(pk__in=cut.running, status=TrajectoryStatus.RUNNING).exists():
        return False
    return not EvalJob.objects.filter(pk__in=cut.eval_jobs, status__in=UNDER_WAY).exists()


# ---------------------------------------------------------------------------- checks


def recovery_problems(cut: Cut, *, media_root: Path, restarted: datetime) -> dict[str, list[str]]:
    """What is wrong after the restart, by check (`CHECKS`); {} when nothing is."""
    found = {
        "running": _left_running(cut, restarted),
        "contiguous": _gaps(cut.run_id),
        "screenshots": _screenshots_missing(cut.run_id, media_root),
        "evaluation": _evaluations_unfinished(cut),
        "groups": _groups_stuck(cut.run_id, restarted),
    }
    return {check: problems for check, problems in found.items() if problems}


def _left_running(cut: Cut, restarted: datetime) -> list[str]:
    """The cut episodes must have ended `aborted` (no worker was left to finish them), and
    every episode running now must have started after the restart."""
    problems = [
        f"trajectory #{pk} cut by the crash ended {status}"
        for pk, status in Trajectory.objects.filter(pk__in=cut.running)
        .exclude(status=TrajectoryStatus.ABORTED)
        .values_list("pk", "status")
    ]
    stale = Trajectory.objects.filter(
        run_id=cut.run_id, status=TrajectoryStatus.RUNNING, started_at__lt=restarted
    )
    problems += [
        f"trajectory #{pk} from before the restart is still running"
        for pk in stale.values_list("pk", flat=True)
    ]
    return problems


def _gaps(run_id: int) -> list[str]:
    """Policy versions 1..n and updates 1..m with none skipped; every stored trajectory's
    steps 0..k-1 with none missing, and its length k. A running trajectory may be read
    between a step's row and its length (`steps_store` writes them one after the other), so
    its length is k or k-1. The steps and the lengths are read in one snapshot
    (`_snapshot`), so a step stored between the two reads cannot make a gap."""
    with _snapshot():
        return _gaps_read(run_id)


@contextlib.contextmanager
def _snapshot() -> Iterator[None]:
    """One transaction whose reads all see the database as it was at the first one:
    PostgreSQL's repeatable read; SQLite's reads inside a transaction already do."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        yield


def _gaps_read(run_id: int) -> list[str]:
    problems = []
    versions = sorted(PolicyVersion.objects.filter(run_id=run_id).values_list("version", flat=True))
    if versions != list(range(1, len(versions) + 1)):
        problems.append(f"policy versions {versions}")
    updates = sorted(TrainUpdate.objects.filter(run_id=run_id).values_list("number", flat=True))
    if updates != list(range(1, len(updates) + 1)):
        problems.append(f"train updates {updates}")
    indexes: dict[int, list[int]] = {}
    for traj, index in Step.objects.filter(trajectory__run_id=run_id).values_list(
        "trajectory", "index"
    ):
        indexes.setdefault(traj, []).append(index)
    rows = Trajectory.objects.filter(run_id=run_id).values_list("pk", "length", "status")
    for traj, length, status in rows:
        got = sorted(indexes.get(traj, []))
        allowed = {len(got), len(got) - 1} if status == TrajectoryStatus.RUNNING else {len(got)}
        if got != list(range(len(got))) or length not in allowed:
            problems.append(f"trajectory #{traj} ({status}): steps {got}, length {length}")
    return problems


def _screenshots_missing(run_id: int, media_root: Path) -> list[str]:
    """Every screenshot a step names is a whole PNG file under the media root."""
    problems = []
    names = Step.objects.filter(trajectory__run_id=run_id).exclude(screenshot="")
    for pk, name in names.values_list("pk", "screenshot"):
        path = media_root / name
        try:
            with path.open("rb") as fh:
                head = fh.read(len(PNG_SIGNATURE))
        except FileNotFoundError:
            problems.append(f"step #{pk}: {name} is missing")
            continue
        if head != PNG_SIGNATURE or path.stat().st_size < 64:
            problems.append(f"step #{pk}: {name} is not a whole PNG ({path.stat().st_size} bytes)")
    return problems


def _evaluations_unfinished(cut: Cut) -> list[str]:
    return [
        f"evaluation #{pk} is {status} ({done}/{total}){f': {error}' if error else ''}"
        for pk, status, done, total, error in EvalJob.objects.filter(pk__in=cut.eval_jobs)
        .exclude(status=EvalStatus.FINISHED)
        .values_list("pk", "status", "done", "total", "error")
    ]


def _groups_stuck(run_id: int, restarted: datetime) -> list[str]:
    """Open groups that can never become ready (`services.episodes._maybe_ready`: a group is
    ready once all its claims are taken and none is running): every claim taken and none
    running, or a claim still running from before the restart (no worker will end it)."""
    problems = []
    for group in TaskGroup.objects.filter(run_id=run_id, status=GroupStatus.OPEN):
        running = Trajectory.objects.filter(group=group, status=TrajectoryStatus.RUNNING)
        if running.filter(started_at__lt=restarted).exists():
            problems.append(f"group #{group.pk}: a claim from before the restart is still running")
        elif group.claimed >= group.budget and not running.exists():
            problems.append(f"group #{group.pk}: all {group.budget} claims ended, still open")
    return problems


def aborted_by(cut: Cut) -> int:
    """How many of the cut episodes ended `aborted`."""
    return Trajectory.objects.filter(pk__in=cut.running, status=TrajectoryStatus.ABORTED).count()
