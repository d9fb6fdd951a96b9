"""`python manage.py run_dartboard`: the whole stack on one machine (what `make run` runs).

Starts the embedded Redis (unless REDIS_URL is set), migrates, creates the local admin on
first start (printing its password once), then web + Celery workers under a supervisor,
and this host's agent (`hostagent.agent`): every run started here, from the browser, the
command line or this launcher's preset, gets its own processes (inference workers and
router, trainer, env workers) and loses them when it stops. `--processes shared` is the
older layout: one rollout service and one set of workers shared by every run.
Ctrl-C (or SIGTERM) stops everything; a new start reaps what a killed launcher left.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from datamanager.models import PlacementState, Run, RunStatus
from datamanager.policies import policy_path
from datamanager.selectors.runs import run_current_policy
from datamanager.services.placement import placement_queue
from datamanager.services.run_workers import run_apply, run_start_workers
from datamanager.services.runs import run_control
from hostagent.agent import HostAgent
from hostagent.embedded_redis import EmbeddedRedis
from hostagent.launcher import (
    Stopped,
    Supervisor,
    default_specs,
    env_worker_specs,
    prepare_home,
    stack_specs,
    stop_on_signals,
    wait_http,
)
from hostagent.main_job import MAIN_RUN_NAMES, prepare_main_run
from hostagent.preflight import Port, port_problem, preflight_problems
from rollout.vllm_command import vllm_gpus, vllm_missing

# How long the web may take to answer. On a restart after a crash it starts beside the
# processes of the runs brought back (`_wait_for_web`): 25-35 s on 2 cores when idle.
WEB_UP_S = 120.0


def _router_port(asked: int | None) -> int:
    """The router's port: the one asked for (then every process the launcher starts is told
    through DARTBOARD_INFERENCE_URLS), else the configured URL's."""
    if asked is None:
        return urlsplit(settings.DARTBOARD_INFERENCE_URLS[0]).port or 8100
    url = f"http://127.0.0.1:{asked}"
    os.environ["DARTBOARD_INFERENCE_URLS"] = url  # the children's settings
    settings.DARTBOARD_INFERENCE_URLS = [url]
    return asked


def _has_gpu() -> bool:
    import torch  # the launcher itself needs torch only for this

    return torch.cuda.is_available()


class Command(BaseCommand):
    help = "Run Dartboard on this machine: embedded Redis, web, Celery workers."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="The dashboard's address.")
        parser.add_argument("--port", type=int, default=8000, help="The dashboard's port.")
        parser.add_argument(
            "--router-port",
            type=int,
            default=None,
            help="The inference router's port on 127.0.0.1; inference worker i takes the "
            "next ports (default: DARTBOARD_INFERENCE_URLS's port, 8100).",
        )
        parser.add_argument(
            "--env-slots",
            type=int,
            default=None,
            help="Shared env worker processes: with per-run processes (the default) they serve "
            "only evaluations that belong to no run (default 1; a run's own slots are its "
            "env.*_slots); with --processes shared, the main run's slots (default: its slot "
            "count, or 2 with --shell-only).",
        )
        parser.add_argument(
            "--shell-only",
            action="store_true",
            help="Only the dashboard and workers: no main job, no inference workers.",
        )
        parser.add_argument(
            "--preset",
            choices=sorted(MAIN_RUN_NAMES),
            default="miniwob",
            help="The main job: MiniWoB++ clicks (make run), the same with vLLM serving LoRA "
            "versions (make run-vllm) or X desktops (make run-desktop).",
        )
        parser.add_argument(
            "--processes",
            choices=("per-run", "shared"),
            default="per-run",
            help="per-run: each run gets its own inference workers, router, trainer and env "
            "workers while it runs (this host's agent starts them); shared: one rollout "
            "service and one set of workers for every run, one model run at a time.",
        )
        parser.add_argument(
            "--exit-after",
            type=float,
            default=0,
            help="Stop after this many seconds (0: run until Ctrl-C). For smoke tests.",
        )

    def handle(
        self,
        *args,
        host,
        port,
        router_port,
        env_slots,
        exit_after,
        shell_only,
        preset,
        processes,
        **options,
    ):
        """Long because it is the launch in order: checks, Redis, database, run, processes."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # the agent polls routers
        home = settings.DARTBOARD_HOME
        router_port = _router_port(router_port)
        per_run = processes == "per-run"
        os.environ["DARTBOARD_PROCESSES"] = processes  # the children's settings
        settings.DARTBOARD_PROCESSES = processes
        ports = [Port(host, port, "the dashboard", "--port")]
        if not shell_only and not per_run:
            ports.append(Port("127.0.0.1", router_port, "the inference router", "--router-port"))
        redis = EmbeddedRedis(settings.REDIS_SOCKET) if settings.REDIS_EMBEDDED else None
        supervisor = Supervisor(home=home, specs=[], redis=redis)
        # What a killed launcher left is stopped (and waited for) before the port check: its
        # web may hold the dashboard's port for a moment after the crash, and a start right
        # then would be refused for a port that is about to be free.
        reaped = supervisor.reap_stale()
        if problems := preflight_problems(home=home, ports=ports):
            raise CommandError("\n\n".join(problems))
        prepare_home(home)  # a 077 umask, and logs, pids, database and secrets private
        stop_on_signals()
        agent = HostAgent(home=home, port_base=router_port) if per_run else None
        run = None
        try:
            if reaped:
                self.stdout.write(f"reaped {len(reaped)} processes left by a killed launcher")
            if redis is not None:
                self.stdout.write(f"starting embedded Redis on {redis.socket_path}")
                redis.start()
            else:
                self.stdout.write(f"using Redis at {settings.REDIS_URL}")
            self.stdout.write(f"database: {settings.DATABASES['default']['ENGINE']}")
            call_command("migrate", interactive=False, verbosity=0)
            self._ensure_admin()
            if per_run:
                # Runs bring their own processes; the shared env workers serve evaluation
                # jobs that belong to no run.
                supervisor.specs = [
                    *stack_specs(host=host, port=port),
                    *env_worker_specs(env_slots if env_slots is not None else 1),
                ]
                if not shell_only:
                    run = prepare_main_run(write=self.stdout.write, preset=preset)
                    vllm = run.cfg.rollout.backend == "vllm"
                    if vllm and (missing := vllm_missing()):
                        raise CommandError(missing)
            elif shell_only:
                supervisor.specs = default_specs(
                    host=host, port=port, env_slots=env_slots or 2, router_port=router_port
                )
            else:
                run = prepare_main_run(write=self.stdout.write, preset=preset)
                cfg = run.cfg
                version, checkpoint = run_current_policy(run=run)
                workers = [
                    Port("127.0.0.1", router_port + 1 + i, f"inference worker {i}", "--router-port")
                    for i in range(cfg.rollout.inference_workers)
                ]
                if problems := [p for p in map(port_problem, workers) if p]:
                    raise CommandError("\n\n".join(problems))
                if cfg.rollout.backend == "vllm":
                    if missing := vllm_missing():
                        raise CommandError(missing)
                    version, checkpoint = 0, policy_path(cfg.policy)  # the first sync loads it
                supervisor.specs = default_specs(
                    host=host,
                    port=port,
                    env_slots=env_slots or len(cfg.env.slots()),
                    inference_policy=str(checkpoint),
                    inference_version=version,
                    inference_workers=cfg.rollout.inference_workers,
                    router_port=router_port,
                    backend=cfg.rollout.backend,
                    vllm_gpus=vllm_gpus(
                        workers=cfg.rollout.inference_workers,
                        placement=cfg.rollout.vllm_gpus,
                        trainer_replicas=max(
                            cfg.trainer.replicas, 1
                        ),  # auto: one on the shared stack
                    ),
                    vllm_gpu_memory=cfg.rollout.vllm_gpu_memory
                    if cfg.rollout.backend == "vllm" and _has_gpu()
                    else None,
                )
            supervisor.start()
            web = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
            if not self._wait_for_web(web + settings.LOGIN_URL, supervisor, agent):
                raise CommandError(
                    f"The dashboard did not answer on {web}/ within {WEB_UP_S:.0f} s. Its log "
                    f"says why: {home / 'logs' / 'web.log'}. Then stop what holds the port, or "
                    "start on another one (--port N)."
                )
            self.stdout.write(self.style.SUCCESS(f"Dartboard is up: http://{host}:{port}/"))
            self.stdout.write(f"logs: {home / 'logs'}; stop with Ctrl-C")
            if run is not None and agent is not None:
                self._queue_run(run.pk)
            elif run is not None:
                self._start_run(run.pk)
            started = time.monotonic()
            while not exit_after or time.monotonic() - started < exit_after:
                supervisor.watch_once()
                if agent is not None:
                    agent.tick()
                time.sleep(1.0)
        except Stopped as stop:
            self.stdout.write(f"{stop}: stopping")
        finally:
            # A second Ctrl-C/SIGTERM must not interrupt the clean-up half way.
            stop_on_signals(False)
            if agent is not None:
                agent.stop_all()  # the runs keep their status: the next start brings them back
            supervisor.stop()  # the embedded Redis last
            self.stdout.write("stopped")

    def _wait_for_web(self, url: str, supervisor: Supervisor, agent: HostAgent | None) -> bool:
        """Poll the dashboard until it answers (False after WEB_UP_S), and meanwhile watch
        the children and tick the host agent: after a crash, the runs placed here get their
        processes back while the web starts instead of after it (on 2 cores each takes about
        25 s, and a run's processes need nothing from the web)."""
        deadline = time.monotonic() + WEB_UP_S
        while not wait_http(url, timeout=1.0):
            if time.monotonic() > deadline:
                return False
            supervisor.watch_once()
            if agent is not None:
                agent.tick()
        return True

    def _queue_run(self, run_id: int) -> None:
        """The preset's run starts like any other (this host's agent brings up its
        processes); a run left running or paused by an earlier launcher comes back with its
        placement, or is placed afresh if it never had one."""
        run = Run.objects.get(pk=run_id)
        if run.status in (RunStatus.CREATED, RunStatus.STOPPED, RunStatus.FAILED):
            run_apply(run_id=run_id, action="start")
        elif run.status in (RunStatus.RUNNING, RunStatus.PAUSED) and not (
            hasattr(run, "placement") and run.placement.state != PlacementState.ENDED
        ):
            placement_queue(run_id=run_id)
        self.stdout.write(f"run #{run_id} starts on this host: /runs/{run_id}/")

    def _start_run(self, run_id: int) -> None:
        """Start the main run (or re-enqueue its workers if it was running) once the
        router answers."""
        router = settings.DARTBOARD_INFERENCE_URLS[0]
        if not wait_http(f"{router}/health", timeout=180):
            self.stderr.write(f"the router at {router} did not come up; see the logs")
            return
        run = Run.objects.get(pk=run_id)
        if run.status in (RunStatus.CREATED, RunStatus.STOPPED, RunStatus.FAILED):
            run_control(run_id=run_id, action="start")
        if Run.objects.get(pk=run_id).status == RunStatus.RUNNING:
            run_start_workers(run_id=run_id)
            self.stdout.write(f"run #{run_id} is running: /runs/{run_id}/")
        else:
            self.stdout.write(f"run #{run_id} is {run.status}; resume it from the dashboard")

    def _ensure_admin(self) -> None:
        User = get_user_model()
        if User.objects.filter(username="admin").exists():
            self.stdout.write(
                "login: admin (password printed at first start; "
                "reset it with `.venv/bin/python manage.py changepassword admin`)"
            )
            return
        password = secrets.token_urlsafe(12)
        User.objects.create_superuser("admin", "", password)
        self.stdout.write(self.style.WARNING(f"login: admin / {password}  (shown once)"))
