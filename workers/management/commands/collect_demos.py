"""`python manage.py collect_demos [--per-task N] [--tasks a,b] [--kinds miniwob,desktop,osworld]
[--policy shipped] [--osworld-address host:port]`:
solve tasks with the scripted oracles in real environments and put the successes in each
task's experience pool. Failed oracle episodes are reported, never stored as demos."""

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from core.imaging import ProcessorNotSupported
from datamanager.config import ConfigError, EnvConfig
from datamanager.models import Task
from datamanager.policies import PolicyNotFound, policy_geometry
from datamanager.services.pool import (
    demo_store,
    pool_count,
    pool_retire_other_geometry,
)
from envmanager.demo_collection import collect_demo
from envmanager.oracles import has_oracle
from workers.env_cache import discard_backend_envs, osworld_target, process_env


class Command(BaseCommand):
    help = "Pre-collect oracle demonstrations into the experience pool."

    def add_arguments(self, parser):
        parser.add_argument("--per-task", type=int, default=3, help="Pool size to reach per task.")
        parser.add_argument(
            "--tasks", default="", help="Comma-separated task names (default: all with an oracle)."
        )
        parser.add_argument("--kinds", default="miniwob", help="Backends: miniwob,desktop,osworld.")
        parser.add_argument(
            "--osworld-address",
            default="",
            help="The VM (host:port) osworld tasks without their own address run on.",
        )
        parser.add_argument("--split", default="train")
        parser.add_argument(
            "--policy",
            default="shipped",
            help="The policy the demos are for: they are written in its model coordinates.",
        )

    def handle(self, *args, per_task, tasks, kinds, split, policy, osworld_address, **options):
        try:
            geometry = policy_geometry(policy)
            vms = EnvConfig(osworld_addresses=[osworld_address] if osworld_address else [])
        except (PolicyNotFound, ProcessorNotSupported, ConfigError) as exc:
            raise CommandError(str(exc)) from None
        kinds = [k for k in kinds.split(",") if k]
        qs = Task.objects.filter(env_kind__in=kinds, split=split)
        if tasks:
            qs = qs.filter(name__in=tasks.split(","))
        retired = sum(pool_retire_other_geometry(task=t, geometry=geometry) for t in qs)
        if retired:
            self.stdout.write(
                f"{retired} pool demos in another image geometry than {policy!r}'s taken out "
                "of the pool (collected again below)"
            )
        todo = [
            t
            for t in qs
            if has_oracle(env_kind=t.env_kind, task_name=t.name) and pool_count(task=t) < per_task
        ]
        stored = failed = 0
        try:
            for task in tqdm(todo, desc="oracle demos", unit="task"):
                vm = None
                if task.env_kind == "osworld":
                    vm = osworld_target(env_config=task.env_config, env=vms, index=0)
                env = process_env(task.env_kind, vm=vm)
                seed = 0
                while pool_count(task=task) < per_task and seed < per_task * 3:
                    spec = task.spec(10_000 + seed)
                    seed += 1
                    outcome = collect_demo(
                        env=env,
                        task=spec,
                        geometry=geometry,
                    )
                    if not outcome.success or not outcome.steps:
                        failed += 1
                        self.stderr.write(
                            f"{task.name} seed {spec.seed}: oracle failed (reward {outcome.reward})"
                        )
                        continue
                    demo_store(
                        task=task,
                        instruction=outcome.instruction,
                        reward=outcome.reward,
                        steps=outcome.steps,
                        geometry=geometry,
                    )
                    stored += 1
        finally:
            for kind in kinds:
                discard_backend_envs(kind)
        self.stdout.write(
            f"demos: {stored} stored, {failed} oracle failures, {len(todo)} tasks topped up"
        )
