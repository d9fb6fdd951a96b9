"""`python manage.py host_agent [--name NAME] [--port-base N]`: this host's agent alone, for a
host that runs runs but not the dashboard (`make run` runs one inside the launcher).

It reports the host (GPUs, CPU inference slots, env kinds), places queued runs that fit
here, starts and stops their processes, and restarts what crashes (`hostagent.agent`). It
reads the same DATABASE_URL and REDIS_URL as the rest of the deployment. Ctrl-C or SIGTERM
stops the runs' processes here; the runs keep their status and placement, and the next
agent on this host brings them back.
"""

from __future__ import annotations

import logging
import os
import time

from django.conf import settings
from django.core.management.base import BaseCommand

from hostagent.agent import HostAgent
from hostagent.launcher import Stopped, Supervisor, prepare_home, stop_on_signals


class Command(BaseCommand):
    help = "This host's agent: start and stop the processes of the runs placed here."

    def add_arguments(self, parser):
        parser.add_argument("--name", default=None, help="The host's name (default: hostname).")
        parser.add_argument(
            "--port-base",
            type=int,
            default=8200,
            help="The first port of the runs' routers and inference workers on 127.0.0.1.",
        )
        parser.add_argument(
            "--exit-after", type=float, default=0, help="Stop after this many seconds (0: never)."
        )

    def handle(self, *args, name, port_base, exit_after, **options):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # the agent polls routers
        home = settings.DARTBOARD_HOME
        prepare_home(home)
        os.environ["DARTBOARD_PROCESSES"] = "per-run"  # the runs' processes' settings
        settings.DARTBOARD_PROCESSES = "per-run"
        stop_on_signals()
        reaped = Supervisor(home=home, specs=[], group="host-agent").reap_stale()
        if reaped:
            self.stdout.write(f"reaped {len(reaped)} processes left by a killed agent")
        agent = HostAgent(home=home, name=name, port_base=port_base)
        self.stdout.write(f"host agent {agent.name}: logs in {home / 'logs'}")
        started = time.monotonic()
        try:
            while not exit_after or time.monotonic() - started < exit_after:
                agent.tick()
                time.sleep(1.0)
        except Stopped as stop:
            self.stdout.write(f"{stop}: stopping the runs' processes")
        finally:
            stop_on_signals(False)
            agent.stop_all()
            self.stdout.write("stopped")
