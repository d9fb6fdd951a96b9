"""The repository layout keeps the standard library importable and the deployment honest."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import compose_substitute

ROOT = Path(__file__).resolve().parent.parent


def test_standard_platform_module_is_not_shadowed():
    # Run from the repository root, where a top-level `platform` package would win.
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import platform; print(platform.__file__); print(platform.system())",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert not out[0].startswith(str(ROOT)), f"platform resolves to the repository: {out[0]}"
    assert out[1] == "Linux"


def test_importing_the_clients_loads_neither_the_router_nor_starlette():
    # Every Celery worker imports RouterAdmin (datamanager/services/run_workers.py); the
    # router's state machine and the ASGI stack belong to the inference hosts.
    code = (
        "import sys, rollout.client; print(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('starlette', 'uvicorn') or m.startswith('rollout.router')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", f"importing rollout.client loaded {out.strip()}"


def _loaded(setup: str, prefixes: tuple[str, ...]) -> list[str]:
    """The top-level packages among `prefixes` a fresh Python holds after `setup`."""
    code = (
        "import json, os, sys; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'dartboard.settings'); "
        f"{setup}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(prefixes)!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("process", "setup", "heavy"),
    [
        # Every Celery worker (env, default, beat) imports the tasks module at start; only the
        # train queue's task loads the trainer. torch, transformers and peft cost an env worker
        # about 4 s of CPU per start, which a 2-core host pays for every slot and restart;
        # pyarrow (and numpy with it) only for a dataset export, which few workers ever write;
        # requests only for an OSWorld slot's client.
        ("a Celery worker", "import django; django.setup(); import workers.tasks",
         ("torch", "transformers", "peft", "scipy", "pyarrow", "requests")),
        ("the web", "import django; django.setup(); import dartboard.urls, dartboard.asgi",
         ("torch", "transformers", "peft", "pyarrow")),
        # An inference worker needs transformers, not peft, until it is sent an adapter. Its
        # imports (torch and transformers) alone take some 5 s of CPU: out of the quick loop.
        pytest.param("an inference worker", "import rollout.server", ("peft",),
                     marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_a_process_loads_only_the_heavy_packages_it_uses(process, setup, heavy):
    loaded = _loaded(setup, heavy)
    assert loaded == [], f"starting {process} loads {loaded}"


def test_every_compose_service_runs_a_real_entry_point():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "minio", "web", "worker-default", "beat", "agent"} <= set(services)
    queues = set()
    for name, svc in services.items():
        cmd = svc.get("command")
        if svc.get("image", "").startswith(("postgres", "redis", "minio", "vllm", "caddy")):
            continue
        assert cmd and cmd[0] == "python", f"{name}: command {cmd!r} does not run the project"
        if cmd[1] == "manage.py":
            from django.core.management import get_commands

            assert cmd[2] in get_commands(), f"{name}: no management command {cmd[2]!r}"
        elif cmd[1] == "-m":
            module = cmd[2]
            if module == "celery" and cmd[5] == "beat":
                # beat's one job: the runs watchdog, handled by a worker of queue default
                from django.conf import settings

                assert cmd[3:5] == ["-A", "dartboard"]
                watchdog = settings.CELERY_BEAT_SCHEDULE["runs-watchdog"]
                assert watchdog["task"] == "workers.tasks.runs_watchdog"
                queues.add("beat:" + watchdog["options"]["queue"])
            elif module == "celery" and cmd[5] == "flower":  # the operators' monitor
                assert cmd[3:5] == ["-A", "dartboard"]
                assert importlib.util.find_spec("flower") is not None
                assert "FLOWER_BASIC_AUTH" in svc["environment"]  # never open
            elif module == "celery":
                assert cmd[3:5] == ["-A", "dartboard"]
                queues.update(cmd[cmd.index("-Q") + 1].split(","))
            elif module == "dartboard.serve":  # the web, served as `make run` serves it
                from hostagent.launcher import stack_specs

                web = next(s for s in stack_specs(host="0.0.0.0", port=8000) if s.name == "web")
                assert cmd[1:] == web.argv[1:]
            else:
                assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
                assert (ROOT / (module.replace(".", "/") + ".py")).exists()
        else:
            raise AssertionError(f"{name}: unexpected command {cmd!r}")
    routed = {route["queue"] for route in settings.CELERY_TASK_ROUTES.values()}
    # Every task has a consumer: a placed run's env and train work goes to its own queues
    # (datamanager.live_work.run_queue), served by the workers its host agent starts, and
    # every service of compose that runs Django has runs placed by an agent.
    assert routed - queues <= {"env", "train"}
    assert settings.CELERY_TASK_DEFAULT_QUEUE in queues
    for name, svc in _dartboard_services().items():
        assert svc["environment"]["DARTBOARD_PROCESSES"] == "per-run", name
    assert "beat:default" in queues  # beat sends the watchdog to a queue a worker consumes


def test_compose_keeps_internal_services_off_the_public_network():
    """Only the TLS proxy publishes ports on every address and joins a routable network's
    public side; PostgreSQL, Redis and MinIO are published on the host's private address
    alone (tests/deploy/test_compose.py); every service that runs Django holds the master
    token, from which the agents derive their runs' tokens."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services, networks = compose["services"], compose["networks"]
    assert networks["internal"]["internal"] is True
    for name, svc in services.items():
        assert "public" not in svc.get("networks", []) or name == "proxy", name
        for port in svc.get("ports", []):
            assert name == "proxy" or port.startswith("${DARTBOARD_HOST_ADDRESS:?"), name
        if svc.get("build"):
            assert "DARTBOARD_SERVICE_TOKEN" in svc["environment"], name


def _readme_command(program: str) -> tuple[dict[str, str], list[str]]:
    """The documented shell command running `program` (docs/scaling-out.md): its
    environment and its arguments."""
    import shlex

    readme = (ROOT / "docs" / "scaling-out.md").read_text()
    block = next(b for b in readme.split("```bash")[1:] if f"{program} " in b.split("```")[0])
    text = block.split("```")[0].replace("\\\n", " ")
    line = next(line for line in text.splitlines() if f"{program} " in line)
    words = shlex.split(line, posix=False)
    env = dict(w.split("=", 1) for w in words[: words.index(program)] if "=" in w)
    return env, words[words.index(program) + 1 :]


def _options(args: list[str]) -> dict[str, str]:
    """--flag value pairs (a flag without a value maps to ""); secrets' values left out."""
    out: dict[str, str] = {}
    for i, word in enumerate(args):
        if word.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
            out[word] = "<secret>" if word == "--api-key" else value
    return out


def test_the_docs_run_vllm_exactly_as_the_launcher_does():
    """docs/scaling-out.md's `vllm serve` by hand: the arguments and environment the launcher
    gives the vLLM it starts for a run (rollout.vllm_command), never a key on the command
    line; the adapter's policy directory is the model vLLM serves."""
    from rollout.vllm_command import VLLM_ENV, vllm_serve_args

    env, args = _readme_command("vllm")
    assert args[0] == "serve"
    readme = {"--model": args[1], **_options(args[2:])}
    launched = _options(vllm_serve_args(model_dir=args[1], host="127.0.0.1", port=8200))
    for deployment_only in ("--host", "--port", "--uds"):
        readme.pop(deployment_only, None)
        launched.pop(deployment_only, None)
    assert readme == launched
    assert "VLLM_API_KEY" in env and "--api-key" not in readme  # the key, never --api-key
    env.pop("VLLM_API_KEY")
    assert env == VLLM_ENV
    _, adapter_args = _readme_command("rollout.vllm_adapter")
    assert _options(adapter_args)["--policy-dir"] == args[1]


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _dartboard_services() -> dict[str, dict]:
    """The services that run this project's image."""
    return {n: s for n, s in _compose()["services"].items() if s.get("build")}


def test_the_dockerfile_installs_what_make_installs():
    """Debian bookworm, the Makefile's apt packages, the lock: the image the README's two
    commands would give on a fresh machine."""
    import re

    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^FROM python:3\.11-slim-bookworm$", dockerfile, re.M)
    apt = re.search(r"apt-get install -y --no-install-recommends ([^&]+)&&", dockerfile, re.S)
    assert apt, "the Dockerfile installs no apt packages"
    wanted = re.search(r"^APT_PACKAGES := (.+)$", makefile, re.M).group(1).split()
    assert sorted(apt.group(1).replace("\\", " ").split()) == sorted(wanted)
    assert "pip install -r requirements.lock" in dockerfile
    for name, service in _dartboard_services().items():
        if service["build"] == ".":
            assert service["image"] == "dartboard:latest", name
        else:  # a GPU host's agent: the same Dockerfile with torch's CUDA build
            assert service["build"] == {"context": ".", "args": {"TORCH": "cuda"}}, name
            assert service["image"] == "dartboard:cuda", name


@pytest.mark.slow  # a subprocess per compose service
def test_every_dartboard_service_starts_its_settings_in_production_with_what_compose_sets(
    tmp_path,
):
    """Every setting a service needs is set: the settings module loads in production mode
    with exactly the environment compose gives (no value of this machine leaks in), with
    Secure cookies that work behind the proxy and runs' processes started by host agents
    (the agents' settings: tests/deploy/test_compose.py)."""
    import json
    import os

    given = {
        "SECRET_KEY": "s" * 50,
        "DARTBOARD_SERVICE_TOKEN": "t" * 40,
        "FLOWER_BASIC_AUTH": "ops:" + "f" * 24,
        "POSTGRES_PASSWORD": "p" * 32,
        "REDIS_PASSWORD": "r" * 32,
        "AWS_SECRET_ACCESS_KEY": "m" * 32,
    }
    services = {n: s for n, s in _dartboard_services().items() if not n.startswith("agent")}
    flower = ("FLOWER_BASIC_AUTH", "DARTBOARD_FLOWER_URL")  # Flower's login, the web's way to it
    envs = {  # the same for all Django services (Flower and the web add only the above)
        tuple(sorted((k, v) for k, v in s["environment"].items() if k not in flower))
        for s in services.values()
    }
    assert len(envs) == 1, "the services' environments drifted apart"
    env = {k: compose_substitute(v, given) for k, v in services["web"]["environment"].items()}
    env["DARTBOARD_HOME"] = str(tmp_path)  # the container's own volume, here a scratch one
    probe = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps({'secure': s.SESSION_COOKIE_SECURE and s.CSRF_COOKIE_SECURE, "
        "'proxy': list(s.SECURE_PROXY_SSL_HEADER), 'csrf': s.CSRF_TRUSTED_ORIGINS, "
        "'db': s.DATABASES['default']['HOST'], 'processes': s.DARTBOARD_PROCESSES, "
        "'artifacts': s.DARTBOARD_ARTIFACTS, 'media': s.STORAGES['default']['BACKEND']}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "DJANGO_SETTINGS_MODULE": "dartboard.settings", **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["secure"] and seen["proxy"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert seen["csrf"] == ["https://localhost"] and seen["db"] == "postgres"
    assert seen["processes"] == "per-run"
    assert seen["artifacts"].startswith("s3://") and seen["media"].endswith("S3Storage")


def test_no_host_path_or_volume_is_shared_between_services():
    """Each service's disk is its own: nothing but PostgreSQL, Redis and the bucket is
    shared."""
    users: dict[str, set[str]] = {}
    for name, svc in _compose()["services"].items():
        for volume in svc.get("volumes", []):
            users.setdefault(volume.split(":")[0], set()).add(name)
    shared = {k: v for k, v in users.items() if len(v) > 1}
    assert shared == {}
    host_paths = {k: users[k] for k in users if k.startswith((".", "/"))}
    # The proxy's configuration (read-only).
    assert host_paths == {"./deploy/Caddyfile": {"proxy"}}, host_paths
    assert (ROOT / "deploy" / "Caddyfile").is_file()


def test_every_long_running_service_is_health_checked_and_redis_keeps_its_data():
    services = _compose()["services"]
    one_shot = {"bucket", "migrate"}
    # No port to ask: beat; the agents, which report to the database every 10 s (the hosts
    # list says when each last did).
    unchecked = {"beat", "agent", "agent-cpu"}
    for name, svc in services.items():
        if name not in one_shot | unchecked:
            assert "healthcheck" in svc, f"{name} has no healthcheck"
    assert services["redis"]["command"][1:3] == ["--appendonly", "yes"]


def test_the_proxy_sends_everything_to_the_web_and_flower_is_reached_through_it():
    """The Caddyfile sends every request to the web (which serves /flower/ to admins only,
    dartboard/flower.py), with body limits; Flower serves under /flower at the address the
    web is given, with the same login."""
    caddyfile = (ROOT / "deploy" / "Caddyfile").read_text()
    routes = [
        line.split()
        for line in caddyfile.splitlines()
        if line.strip().startswith(("handle", "reverse_proxy", "request_body", "max_size"))
    ]
    assert routes == [["request_body", "@upload", "{"], ["max_size", "257MiB"],
                      ["request_body", "@other", "{"], ["max_size", "10MiB"],
                      ["reverse_proxy", "web:8000"]]  # fmt: skip
    services = _compose()["services"]
    flower, web = services["flower"], services["web"]["environment"]
    assert "--url_prefix=flower" in flower["command"] and "--port=5555" in flower["command"]
    assert web["DARTBOARD_FLOWER_URL"] == "http://flower:5555"
    assert web["FLOWER_BASIC_AUTH"] == flower["environment"]["FLOWER_BASIC_AUTH"]
    assert _compose()["services"]["proxy"]["command"][-3:] == [
        "/etc/caddy/Caddyfile",
        "--adapter",
        "caddyfile",
    ]
