"""The Slurm batch script (deploy/slurm/dartboard-agents.sbatch) on a real Slurm cluster.

Debian's slurm-wlm on this machine: a slurmctld and two slurmd, each node a network namespace
of the test's own (tests/netns.py) with its own hostname and address, no cgroups needed
(proctrack/linuxproc, task/none; GPUs as a gres backed by /dev/null, so Slurm sets
CUDA_VISIBLE_DEVICES as it would). The services host runs the controller, PostgreSQL and
Redis on its veth address. `sbatch --nodes=2` of the script, as a user submits it, must start
one host agent per node through srun, each reporting its node with that node's own address;
an agent killed with SIGKILL comes back; `scancel --signal=TERM` stops both cleanly and the
job completes. No run is started, so nothing reaches the S3 store the script is given.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import netns
from tests.helpers import needs, wait_until
from tests.private_services import postgres_bindir, services_host

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "dartboard-agents.sbatch"
NODES = ("a", "b")
SLURM_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "scancel", "squeue", "sinfo", "scontrol")


def slurm_missing() -> str | None:
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt slurm-wlm; `make test` installs it)"
    return netns.available()


def slurm_conf(root: Path, hosts: netns.VirtualHosts) -> Path:
    """One controller on the services host, one node per host in NODES with one GPU each;
    everything in `root`, nothing in /etc or /var."""
    nodes = "\n".join(
        f"NodeName={hosts.hostname(n)} NodeAddr={hosts.address(n)} CPUs=2 Gres=gpu:1 State=UNKNOWN"
        for n in NODES
    )
    names = ",".join(hosts.hostname(n) for n in NODES)
    conf = root / "slurm.conf"
    conf.write_text(
        f"""ClusterName=dbtest
SlurmctldHost={hosts.hostname("svc")}({hosts.address("svc")})
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MailProg=/bin/true
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{nodes}
PartitionName=gpu Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
    )
    (root / "gres.conf").write_text(
        "".join(f"NodeName={hosts.hostname(n)} Name=gpu File=/dev/null\n" for n in NODES)
    )
    for d in ("state", *(f"spool-{hosts.hostname(n)}" for n in NODES)):
        (root / d).mkdir()
    return conf


@dataclass
class Cluster:
    hosts: netns.VirtualHosts
    root: Path
    env: dict[str, str]  # the submitting user's environment
    slurmd: dict[str, subprocess.Popen[bytes]]

    def slurm(self, *argv: str) -> str:
        """A Slurm client command on the services host (the login node)."""
        return self.hosts.run("svc", list(argv), env=self.env, timeout=60)

    def sql(self, query: str) -> list[list[str]]:
        psql = str(postgres_bindir() / "psql")
        svc = self.hosts.address("svc")
        out = self.hosts.run(
            "svc",
            [psql, "-h", svc, "-U", "postgres", "-d", "dartboard", "-At", "-F", " ", "-c", query],
        )
        return [line.split(" ") for line in out.splitlines() if line]

    def job(self, job_id: str) -> dict[str, str]:
        line = self.slurm("scontrol", "-o", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def stop_jobs(self) -> None:
        """What a failed test left running: every job cancelled as a user would, then gone."""
        self.slurm("scancel", "--signal=TERM", "--user=root")
        wait_until(
            lambda: not self.slurm("squeue", "-h").strip(),
            timeout=60,
            interval=0.5,
            what="the jobs ending",
        )

    def left_on(self, node: str) -> list[int]:
        """Processes in the node's namespace other than its slurmd."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.hosts.namespace(node)], capture_output=True, text=True
        ).stdout
        return [int(p) for p in out.split() if int(p) != self.slurmd[node].pid]


def submit_env(cluster_root: Path, hosts: netns.VirtualHosts, **services: str) -> dict[str, str]:
    """The user's environment at sbatch: the services by the services host's address and the
    secrets, nothing of this test process's own (its database, Redis, home, Slurm job)."""
    own = (
        "DARTBOARD_",
        "DATABASE_URL",
        "REDIS_URL",
        "TEST_",
        "AWS_",
        "DJANGO_",
        "ALLOWED_",
        "SLURM_",
        "SBATCH_",
        "PYTEST_",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    svc = hosts.address("svc")
    return {
        **env,
        "SLURM_CONF": str(cluster_root / "slurm.conf"),
        "DATABASE_URL": f"postgres://postgres@{svc}:5432/dartboard",
        "DARTBOARD_S3_BUCKET": "dartboard",
        "DARTBOARD_ARTIFACTS": "s3://dartboard/artifacts",
        "AWS_S3_ENDPOINT_URL": f"http://{svc}:9000",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "DARTBOARD_SERVICE_TOKEN": secrets.token_urlsafe(40),
        "DARTBOARD_DIR": str(ROOT),
        "DARTBOARD_PYTHON": sys.executable,
        "DARTBOARD_NODE_DIR": str(cluster_root / "local"),
        **services,
    }


@pytest.fixture
@needs("live")
def slurm_cluster(tmp_path: Path) -> Iterator[Cluster]:
    why = slurm_missing()
    if why:
        pytest.skip(why)
    hosts = netns.VirtualHosts(["svc", *NODES])
    cleanups: list = [hosts.remove]
    try:
        hosts.create()
        svc = hosts.address("svc")
        on_svc = lambda argv: hosts.argv("svc", argv)  # noqa: E731
        services = services_host(address=svc, wrap=on_svc, redis_dir=tmp_path,
                                 cleanups=cleanups)  # fmt: skip  # one call
        # slurmd's step sockets live in its spool directory and a unix socket path holds 108
        # bytes: pytest's temporary paths (under xdist, .../popen-gw2/test_...) are too long.
        root = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        cleanups.append(lambda: shutil.rmtree(root, ignore_errors=True))
        conf = slurm_conf(root, hosts)
        env = submit_env(root, hosts, REDIS_URL=services.redis_url)
        # The operator's one-shot, from the services host: the schema.
        migrate_env = {**env, "DARTBOARD_HOME": str(tmp_path / "svc-home")}
        hosts.run(
            "svc",
            [sys.executable, str(ROOT / "manage.py"), "migrate", "--no-input"],
            env=migrate_env,
            timeout=300,
        )
        daemons = {"svc": ["slurmctld", "-D", "-i", "-f", str(conf)]}
        daemons |= {n: ["slurmd", "-D", "-N", hosts.hostname(n), "-f", str(conf)] for n in NODES}
        started: dict[str, subprocess.Popen[bytes]] = {}
        for host, argv in daemons.items():
            with open(root / f"{argv[0]}-{host}.out", "wb") as out:
                proc = subprocess.Popen(
                    hosts.argv(host, argv), env=env, stdout=out, stderr=subprocess.STDOUT
                )
            started[host] = proc
            cleanups.append(lambda proc=proc: (proc.terminate(), proc.wait(30)))
        cluster = Cluster(hosts=hosts, root=root, env=env, slurmd={n: started[n] for n in NODES})
        cleanups.append(lambda: cluster.stop_jobs())  # the agents first, while the services run
        wanted = {f"{hosts.hostname(n)} idle" for n in NODES}
        wait_until(
            lambda: set(cluster.slurm("sinfo", "-h", "-N", "-o", "%N %T").splitlines()) >= wanted,
            timeout=60,
            interval=0.5,
            what=f"both slurmd idle (logs in {root})",
        )
        yield cluster
    finally:
        for cleanup in reversed(cleanups):  # last made, first removed; every one is tried
            with contextlib.suppress(Exception):
                cleanup()


def agent_pid(cluster: Cluster, node: str) -> int | None:
    """The host agent's process on `node` (`manage.py host_agent`), if one runs."""
    for pid in cluster.left_on(node):
        with contextlib.suppress(OSError):
            if b"manage.py\0host_agent" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


@pytest.mark.slow
def test_the_batch_script_starts_an_agent_per_node_that_scancel_stops(slurm_cluster):
    cluster, hosts = slurm_cluster, slurm_cluster.hosts
    output = cluster.root / "job.out"
    job = cluster.slurm(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--gres=gpu:1",
        f"--output={output}",
        f"--chdir={cluster.root}",
        str(SCRIPT),
    ).strip()

    def reported() -> list[list[str]]:
        state = cluster.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"job {state}: {output.read_text()[-3000:]}"
        return cluster.sql(
            "SELECT name, address, extract(epoch FROM last_seen) FROM datamanager_host ORDER BY name"
        )

    rows = wait_until(
        lambda: len(reported()) == 2 and reported(),
        timeout=180,
        interval=1,
        what="an agent on each node reporting",
    )
    # Each node's agent, under the node's Slurm name, with the node's own address: where its
    # runs' routers listen and the other nodes reach them.
    assert [r[:2] for r in rows] == [[hosts.hostname(n), hosts.address(n)] for n in NODES]
    info = cluster.job(job)
    assert info["JobState"] == "RUNNING" and info["NodeList"] == "host-a,host-b"
    for n in NODES:  # each agent's home on its own node's disk
        home = cluster.root / "local" / f"dartboard-{hosts.hostname(n)}"
        assert f"host agent {hosts.hostname(n)}: logs in {home / 'logs'}" in output.read_text()

    # An agent that dies is started again by its node's step (as it brings back its runs).
    killed = agent_pid(cluster, "b")
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    seen = dict((r[0], r[2]) for r in reported())["host-b"]  # its last report
    wait_until(
        lambda: (
            agent_pid(cluster, "b") not in (None, killed)
            and dict((r[0], r[2]) for r in reported())["host-b"] != seen
        ),
        timeout=120,
        interval=1,
        what="host-b's agent started again and reporting",
    )
    assert "the agent on host-b exited (137); starting it again in 10 s" in output.read_text()

    # scancel --signal=TERM: both agents stop their runs' processes and exit, the job ends.
    cluster.slurm("scancel", "--signal=TERM", job)
    wait_until(
        lambda: cluster.job(job)["JobState"] not in ("RUNNING", "COMPLETING"),
        timeout=120,
        interval=0.5,
        what="the job ending after scancel",
    )
    info = cluster.job(job)
    log = output.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert sorted(re.findall(r"^(\d+): stopped$", log, re.M)) == ["0", "1"], log[-3000:]
    for n in NODES:
        wait_until(
            lambda n=n: not cluster.left_on(n), timeout=30, what=f"nothing of the job left on {n}"
        )


def run_script(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The script as the batch step runs it, here (it checks before it starts anything)."""
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_the_batch_script_refuses_what_the_other_nodes_cannot_reach(tmp_path):
    """Before any node starts: every missing variable at once, and services at this machine's
    own addresses, each with what to set."""
    base = {"PATH": os.environ["PATH"]}
    done = run_script({**base, "DATABASE_URL": "postgres://db.internal:5432/dartboard"})
    assert done.returncode == 2
    assert done.stderr.startswith(
        "dartboard-agents: set REDIS_URL DARTBOARD_S3_BUCKET DARTBOARD_ARTIFACTS SECRET_KEY "
        "DARTBOARD_SERVICE_TOKEN in the environment you submit from"
    )
    complete = {
        **base,
        "DATABASE_URL": "postgres://u:p@db.internal:5432/d",
        "REDIS_URL": "redis://:pw@redis.internal:6379/0",
        "DARTBOARD_S3_BUCKET": "b",
        "DARTBOARD_ARTIFACTS": "s3://b/artifacts",
        "SECRET_KEY": "k",
        "DARTBOARD_SERVICE_TOKEN": "t",
        "DARTBOARD_PYTHON": str(tmp_path / "none"),
    }
    refused = {
        ("DATABASE_URL", "sqlite:////var/db.sqlite3"): "DATABASE_URL (sqlite",
        ("DATABASE_URL", "postgres://u:p@127.0.0.1:5432/d"): "DATABASE_URL (postgres://u:p@127",
        ("DATABASE_URL", "postgres://localhost/d"): "is this machine's own",
        ("REDIS_URL", "redis://localhost:6379/0"): "REDIS_URL (redis://localhost",
        ("REDIS_URL", "unix:///run/redis.sock"): "REDIS_URL (unix",
        ("DARTBOARD_ARTIFACTS", "file:///var/artifacts"): "must be an s3:// store",
        ("DARTBOARD_PYTHON", str(tmp_path / "none")): f"no Python at {tmp_path / 'none'}",
    }
    for (name, value), says in refused.items():
        done = run_script({**complete, name: value})
        assert done.returncode == 2 and says in done.stderr, (name, value, done.stderr)
