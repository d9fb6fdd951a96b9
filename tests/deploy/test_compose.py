"""The compose deployment over several hosts: docker-compose.yml on the first host (the
services, the web and a host agent) and deploy/compose-agent.yml on each further host (an
agent alone, pointed at the first host's services). No container runtime runs here, so what
is checked is what the files say, read as compose reads them, and that `docker compose
config` accepts them where a compose client is installed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import compose_substitute

ROOT = Path(__file__).resolve().parents[2]
FIRST = ROOT / "docker-compose.yml"
FURTHER = ROOT / "deploy" / "compose-agent.yml"
# What a further host's agent reaches on the first host's private address.
SHARED = {"postgres": 5432, "redis": 6379, "minio": 9000}
HOST = "${DARTBOARD_HOST_ADDRESS:?set DARTBOARD_HOST_ADDRESS}"
# Every variable the two files require, as a user sets them.
GIVEN = {
    "DARTBOARD_HOST_ADDRESS": "10.0.0.2", "DARTBOARD_HOST_NAME": "gpu-1",
    "DARTBOARD_SERVICES_ADDRESS": "10.0.0.2", "POSTGRES_PASSWORD": "p" * 32,
    "REDIS_PASSWORD": "r" * 32, "AWS_SECRET_ACCESS_KEY": "m" * 32,
    "DARTBOARD_ARTIFACTS_READ_SECRET_KEY": "q" * 32, "SECRET_KEY": "s" * 50,
    "DARTBOARD_SERVICE_TOKEN": "t" * 40, "FLOWER_BASIC_AUTH": "ops:" + "f" * 24,
}  # fmt: skip


def _services(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())["services"]


def _agents() -> dict[str, dict[str, Any]]:
    """Every agent service of both files: "first/agent", "further/agent-cpu"..."""
    return {
        f"{where}/{name}": svc
        for where, path in (("first", FIRST), ("further", FURTHER))
        for name, svc in _services(path).items()
        if svc.get("command", [])[1:3] == ["manage.py", "host_agent"]
    }


def test_an_agent_on_each_host_starts_its_runs_processes_at_the_hosts_private_address():
    agents = _agents()
    assert set(agents) == {"first/agent", "first/agent-cpu", "further/agent", "further/agent-cpu"}
    for where, agent in agents.items():
        env = agent["environment"]
        # Each run gets its own processes from the agent, never a shared rollout service.
        assert env["DARTBOARD_PROCESSES"] == "per-run", where
        assert env["DARTBOARD_HOST_ADDRESS"].startswith("${DARTBOARD_HOST_ADDRESS:?"), where
        # Named by the user, so the next agent of that name brings back its runs.
        assert agent["command"][:4] == ["python", "manage.py", "host_agent", "--name"], where
        assert agent["command"][4].startswith("${DARTBOARD_HOST_NAME:?"), where
        # Its runs listen at that address: the host's network, not a bridge's.
        assert agent["network_mode"] == "host" and "networks" not in agent, where
        # The env slots' sandboxes take a uid of their own, tmpfs mounts and cgroups.
        assert agent["privileged"] is True and agent["user"] == "root", where
        assert int(agent["stop_grace_period"].removesuffix("s")) >= 90, where
        assert agent["restart"] == "unless-stopped", where
        assert any(v.endswith(":/var/lib/dartboard") for v in agent["volumes"]), where
        # The inference workers get the read-only pair, never the writing keys.
        assert env["DARTBOARD_ARTIFACTS_READ_SECRET_KEY"].startswith("${"), where
    # The first host's agents wait for the schema and the bucket; a further host's agent is
    # started once the first host is up.
    for name in ("first/agent", "first/agent-cpu"):
        assert set(agents[name]["depends_on"]) == {"migrate", "bucket"}, name
    for name in ("further/agent", "further/agent-cpu"):
        assert "depends_on" not in agents[name], name


def test_a_further_hosts_agent_is_the_first_hosts_pointed_at_its_services():
    """Both files give their agents the same image, command and environment, but for where
    PostgreSQL, Redis and MinIO are: this host's private address on the first host, the first
    host's (DARTBOARD_SERVICES_ADDRESS) on the others, each with its password."""
    at = {"first": "DARTBOARD_HOST_ADDRESS", "further": "DARTBOARD_SERVICES_ADDRESS"}
    where_services = {
        "DATABASE_URL": "postgres://postgres:${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}@{}:5432/dartboard",
        "REDIS_URL": "redis://:${REDIS_PASSWORD:?set REDIS_PASSWORD}@{}:6379/0",
        "AWS_S3_ENDPOINT_URL": "http://{}:9000",
    }  # fmt: skip
    seen: dict[str, dict[str, Any]] = {}
    for where, agent in _agents().items():
        env = dict(agent["environment"])
        address = re.compile(r"\$\{" + at[where.split("/")[0]] + r":\?[^}]*\}")
        for key, shape in where_services.items():
            value = env.pop(key)
            assert address.sub("{}", value) == shape, (where, key, value)
        seen[where] = {**agent, "environment": env}
    for name in ("agent", "agent-cpu"):
        first, further = seen[f"first/{name}"], seen[f"further/{name}"]
        for key in ("command", "environment", "image", "network_mode", "privileged", "user",
                    "stop_grace_period", "deploy", "profiles", "volumes"):  # fmt: skip
            assert first.get(key) == further.get(key), (name, key)
        build = first["build"] if isinstance(first["build"], dict) else {"context": "."}
        again = further["build"] if isinstance(further["build"], dict) else {"context": ".."}
        # The further file lives in deploy/: its context is the checkout's root too.
        assert (FIRST.parent / build["context"]).resolve() == ROOT, name
        assert (FURTHER.parent / again["context"]).resolve() == ROOT, name
        assert build.get("args") == again.get("args"), name


def test_gpu_hosts_agents_reserve_every_gpu_with_torchs_cuda_build():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH=cpu" in dockerfile and "-r requirements-cuda.txt" in dockerfile
    for path in (FIRST, FURTHER):
        services = _services(path)
        reserving = {
            name
            for name, svc in services.items()
            if svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        }
        assert reserving == {"agent"}, path  # no other service runs on a GPU
        (device,) = services["agent"]["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
        assert services["agent"]["build"]["args"] == {"TORCH": "cuda"}
        assert services["agent"]["image"] == "dartboard:cuda"
        assert "profiles" not in services["agent"]  # `up -d` starts it on a GPU host
        # A host without GPUs starts its agent by name (a reservation fails there).
        cpu = services["agent-cpu"]
        assert cpu["profiles"] == ["cpu"] and cpu["image"] == "dartboard:latest"
        assert "deploy" not in cpu


def test_only_the_shared_services_are_published_on_the_private_address_with_passwords():
    """A further host needs PostgreSQL, Redis and MinIO (each run's router is the run's own,
    on its agent's host): published on the first host's private address alone, each with a
    password of the user's. The TLS proxy is the only service published on every address."""
    services = _services(FIRST)
    published = {n: s["ports"] for n, s in services.items() if s.get("ports")}
    assert published == {
        "proxy": ["443:443", "80:80"],
        **{n: [f"{HOST}:{p}:{p}"] for n, p in SHARED.items()},
    }
    assert not any(s.get("ports") for s in _services(FURTHER).values())
    runs = {"rollout.router", "rollout.server", "rollout.vllm_adapter"}
    assert not [n for n, s in services.items() if set(s.get("command") or []) & runs]
    # No default password once the port is published.
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith(
        "${POSTGRES_PASSWORD:?"
    )
    minio = services["minio"]["environment"]
    assert minio["MINIO_ROOT_PASSWORD"].startswith("${AWS_SECRET_ACCESS_KEY:?")
    redis = services["redis"]["command"]
    assert redis[redis.index("--requirepass") + 1] == "${REDIS_PASSWORD:?set REDIS_PASSWORD}"
    assert services["redis"]["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD:?")
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    # Published ports need a network with a route out; the rest stays on the internal one.
    networks = yaml.safe_load(FIRST.read_text())["networks"]
    assert networks["internal"] == {"internal": True} and networks["private"] == {}
    for name in SHARED:
        assert set(services[name]["networks"]) == {"internal", "private"}, name
    # The web and the default worker reach the runs' routers at their hosts' addresses.
    for name in ("web", "worker-default"):
        assert "private" in services[name]["networks"], name


def _settings_seen(env: dict[str, Any], home: Path) -> list[Any]:
    """What the settings module makes of exactly the service environment `env`."""
    env = {k: compose_substitute(v, GIVEN) for k, v in env.items()}
    env["DARTBOARD_HOME"] = str(home)  # the container's own volume, here a scratch one
    probe = (
        "import json; from django.conf import settings as s; "
        "d = s.DATABASES['default']; "
        "print(json.dumps([s.PRODUCTION, s.REDIS_URL, d['HOST'], d['PASSWORD'], "
        "s.DARTBOARD_PROCESSES, s.DARTBOARD_HOST_ADDRESS, "
        "s.STORAGES['default']['OPTIONS']['endpoint_url']]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "DJANGO_SETTINGS_MODULE": "dartboard.settings", **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_web_and_every_agent_load_their_settings_with_the_passwords(tmp_path):
    """In production mode, from exactly what compose gives them: the web reaches the
    services by name on the internal network, an agent at the first host's address."""
    web = _services(FIRST)["web"]["environment"]
    r, p = GIVEN["REDIS_PASSWORD"], GIVEN["POSTGRES_PASSWORD"]
    assert _settings_seen(web, tmp_path / "web") == [
        True, f"redis://:{r}@redis:6379/0", "postgres", p, "per-run", "127.0.0.1",
        "http://minio:9000"]  # fmt: skip
    further = _services(FURTHER)["agent"]["environment"]
    given = {**GIVEN, "DARTBOARD_HOST_ADDRESS": "10.0.0.11"}
    env = {k: compose_substitute(v, given) for k, v in further.items()}
    assert _settings_seen(env, tmp_path / "agent") == [
        True, f"redis://:{r}@10.0.0.2:6379/0", "10.0.0.2", p, "per-run", "10.0.0.11",
        "http://10.0.0.2:9000"]  # fmt: skip


@functools.cache
def _compose_client() -> tuple[str, ...] | None:
    """`docker compose` (the plugin) or `docker-compose`, where one answers here."""
    for command in (("docker", "compose"), ("docker-compose",)):
        if shutil.which(command[0]) is None:
            continue
        if subprocess.run([*command, "version"], capture_output=True).returncode == 0:
            return command
    return None


@pytest.mark.parametrize("path", [FIRST, FURTHER], ids=["first", "further"])
def test_docker_compose_config_accepts_the_files_and_names_what_is_missing(path):
    """`docker compose config` validates a file against the compose schema and interpolates
    it without a daemon (the `cpu` profile: every service of the file)."""
    client = _compose_client()
    if client is None:
        pytest.skip("no compose client here: the docker client has no compose plugin and "
                    "there is no docker-compose")  # fmt: skip
    command = [*client, "-f", str(path), "--profile", "cpu", "config"]
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    done = subprocess.run(command, cwd=ROOT, env={**base, **GIVEN}, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    for name in ("agent", "agent-cpu"):
        env = resolved[name]["environment"]
        assert (
            env["DARTBOARD_PROCESSES"] == "per-run"
            and env["DARTBOARD_HOST_ADDRESS"] == (GIVEN["DARTBOARD_HOST_ADDRESS"])
        ), name
    missing = {k: v for k, v in GIVEN.items() if k != "DARTBOARD_HOST_ADDRESS"}
    refused = subprocess.run(command, cwd=ROOT, env={**base, **missing}, capture_output=True,
                             text=True)  # fmt: skip
    assert refused.returncode != 0 and "set DARTBOARD_HOST_ADDRESS" in refused.stderr
