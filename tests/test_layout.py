"""The repository layout keeps the standard library importable and the deployment honest."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    assert {
        "postgres",
        "redis",
        "web",
        "worker-env",
        "worker-default",
        "worker-train",
        "beat",
        "vllm",
    } <= set(services)
    assert services["vllm"]["profiles"] == ["gpu"]
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
    assert routed | {settings.CELERY_TASK_DEFAULT_QUEUE} <= queues  # every task has a consumer
    assert "beat:default" in queues  # beat sends the watchdog to a queue a worker consumes


def test_compose_keeps_internal_services_off_the_public_network():
    """Only the TLS proxy publishes ports and joins a routable network; vLLM (whose dev mode
    reloads weights over HTTP) is reachable only from its adapter; the services that run
    Django hold the master token, the rollout services only their purposes' tokens."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services, networks = compose["services"], compose["networks"]
    assert networks["internal"]["internal"] is True and networks["vllm"]["internal"] is True
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"proxy"}
    for name, svc in services.items():
        joined = set(svc["networks"])
        assert "public" not in joined or name == "proxy", name
        assert "vllm" not in joined or name in ("vllm", "vllm-adapter"), name
        if name == "vllm":
            assert joined == {"vllm"}
        env = svc.get("environment", {})
        if name in _rollout_services():
            assert {"DARTBOARD_INFERENCE_TOKEN", "DARTBOARD_ADMIN_TOKEN"} <= set(env), name
            assert not set(env) & set(DJANGO_ONLY), name
        elif "image" not in svc or svc.get("build"):
            assert "DARTBOARD_SERVICE_TOKEN" in env, name


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


# What only the services that run Django may hold (secrets by need, rollout/auth.py).
DJANGO_ONLY = ("SECRET_KEY", "DATABASE_URL", "REDIS_URL", "DARTBOARD_SERVICE_TOKEN",
               "DARTBOARD_S3_BUCKET")  # fmt: skip


def _rollout_services() -> set[str]:
    """The compose services that run the rollout service (router, inference workers,
    the vLLM adapter): no Django, and none of its secrets."""
    modules = ("rollout.router", "rollout.server", "rollout.vllm_adapter")
    return {
        name
        for name, svc in _compose()["services"].items()
        if svc.get("build") and svc["command"][1] == "-m" and svc["command"][2] in modules
    }


def _options(args: list[str]) -> dict[str, str]:
    """--flag value pairs (a flag without a value maps to ""); secrets' values left out."""
    out: dict[str, str] = {}
    for i, word in enumerate(args):
        if word.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
            out[word] = "<secret>" if word == "--api-key" else value
    return out


def test_the_readme_runs_vllm_exactly_as_compose_does():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    env, args = _readme_command("vllm")
    assert args[0] == "serve"
    readme = {"--model": args[1], **_options(args[2:])}
    composed = _options(compose["vllm"]["command"])
    for deployment_only in ("--host", "--port", "--uds"):
        readme.pop(deployment_only, None)
        composed.pop(deployment_only, None)
    assert readme == composed
    compose_env = dict(compose["vllm"]["environment"])
    assert "VLLM_API_KEY" in env and "VLLM_API_KEY" in compose_env  # the key, never --api-key
    assert "--api-key" not in readme and "--api-key" not in composed
    env.pop("VLLM_API_KEY"), compose_env.pop("VLLM_API_KEY")
    assert env == compose_env
    _, adapter_args = _readme_command("rollout.vllm_adapter")
    adapter = _options(compose["vllm-adapter"]["command"][3:])
    assert _options(adapter_args)["--policy-dir"] == adapter["--policy-dir"] == "/models/policy"


def test_compose_runs_vllm_with_the_launchers_arguments():
    from rollout.vllm_command import VLLM_ENV, vllm_serve_args

    service = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["vllm"]
    composed = _options(service["command"])
    # Compose's vLLM joins a network only its adapter reaches, so the trainer's weight server
    # is out of its reach: it loads every version from a checkpoint, without the extension.
    launched = _options(
        vllm_serve_args(model_dir="/models/policy", host="0.0.0.0", port=8200, pull_weights=False)
    )
    assert composed == launched and "--api-key" not in composed
    environment = service["environment"]
    assert "VLLM_API_KEY" in environment  # read by vLLM itself: no key on a command line
    assert {k: v for k, v in environment.items() if k != "VLLM_API_KEY"} == VLLM_ENV


def _mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """A service's mounts: path inside -> (source, read-only)."""
    out = {}
    for volume in service.get("volumes", []):
        source, path, *mode = volume.split(":")
        out[path] = (source, mode == ["ro"])
    return out


def test_vllm_reads_every_path_its_adapter_hands_it():
    """The adapter reloads vLLM from checkpoints it names by path: the models it was started
    with, and the versions it fetched into its artifact cache. vLLM's container must see the
    same volume at the same path (read-only), or every version sync fails."""
    services = _compose()["services"]
    vllm, adapter = _mounts(services["vllm"]), _mounts(services["vllm-adapter"])
    cache = services["vllm-adapter"]["environment"]["DARTBOARD_ARTIFACT_CACHE"]
    for path in ("/models", cache):
        assert path in adapter and path in vllm, path
        assert vllm[path] == (adapter[path][0], True), path


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _dartboard_services() -> dict[str, dict]:
    """The services that run this project's image."""
    return {n: s for n, s in _compose()["services"].items() if s.get("build")}


def _substitute(value: str, given: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR:?message}, with `given` for the required ones."""
    import re

    def one(match: re.Match) -> str:
        name, op, rest = match.group(1), match.group(2), match.group(3)
        if name in given:
            return given[name]
        assert op == ":-", f"${{{name}}} is required ({rest}) and the test gives no value"
        return rest

    return re.sub(r"\$\{([A-Z_]+)(:[-?])([^}]*)\}", one, str(value))


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
    for service in _dartboard_services().values():
        assert service["build"] == "." and service["image"] == "dartboard:latest"


@pytest.mark.slow  # a subprocess per compose service
def test_every_dartboard_service_starts_its_settings_in_production_with_what_compose_sets(
    tmp_path,
):
    """Every setting a service needs is set: the settings module loads in production mode
    with exactly the environment compose gives (no value of this machine leaks in), with
    Secure cookies that work behind the proxy and the rollout service at the router."""
    import json
    import os

    given = {
        "SECRET_KEY": "s" * 50,
        "DARTBOARD_SERVICE_TOKEN": "t" * 40,
        "DARTBOARD_INFERENCE_TOKEN": "i" * 40,
        "DARTBOARD_ADMIN_TOKEN": "a" * 40,
        "FLOWER_BASIC_AUTH": "ops:" + "f" * 24,
    }
    services = {n: s for n, s in _dartboard_services().items() if n not in _rollout_services()}
    flower = ("FLOWER_BASIC_AUTH", "DARTBOARD_FLOWER_URL")  # Flower's login, the web's way to it
    envs = {  # the same for all Django services (Flower and the web add only the above)
        tuple(sorted((k, v) for k, v in s["environment"].items() if k not in flower))
        for s in services.values()
    }
    assert len(envs) == 1, "the services' environments drifted apart"
    env = {k: _substitute(v, given) for k, v in services["web"]["environment"].items()}
    env["DARTBOARD_HOME"] = str(tmp_path)  # the container's own volume, here a scratch one
    probe = (
        "import django, json; django.setup(); from django.conf import settings as s; "
        "print(json.dumps({'secure': s.SESSION_COOKIE_SECURE and s.CSRF_COOKIE_SECURE, "
        "'proxy': list(s.SECURE_PROXY_SSL_HEADER), 'csrf': s.CSRF_TRUSTED_ORIGINS, "
        "'db': s.DATABASES['default']['HOST'], 'inference': s.DARTBOARD_INFERENCE_URLS, "
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
    assert seen["inference"] == ["http://router:8100"]
    assert seen["artifacts"].startswith("s3://") and seen["media"].endswith("S3Storage")


def test_no_host_path_or_volume_is_shared_between_services():
    """Each service's disk is its own: nothing but PostgreSQL, Redis and the bucket is shared
    (vLLM and its adapter read the one model volume of their GPU host, and the versions the
    adapter fetched)."""
    users: dict[str, set[str]] = {}
    for name, svc in _compose()["services"].items():
        for volume in svc.get("volumes", []):
            users.setdefault(volume.split(":")[0], set()).add(name)
    shared = {k: v for k, v in users.items() if len(v) > 1}
    pair = {"vllm", "vllm-adapter"}
    assert shared == {"models": pair, "vllm-artifacts": pair}
    host_paths = {k: users[k] for k in users if k.startswith((".", "/"))}
    # The proxy's configuration (read-only).
    assert host_paths == {"./deploy/Caddyfile": {"proxy"}}, host_paths
    assert (ROOT / "deploy" / "Caddyfile").is_file()


def test_inference_workers_register_with_the_router_the_platform_calls():
    services = _compose()["services"]
    router_url = services["web"]["environment"]["DARTBOARD_INFERENCE_URLS"]
    assert services["router"]["command"][:3] == ["python", "-m", "rollout.router"]
    assert router_url == "http://router:8100" and "8100" in services["router"]["command"]
    for name in ("inference", "vllm-adapter"):
        command = services[name]["command"]
        assert command[command.index("--register") + 1] == router_url, name


def test_every_long_running_service_is_health_checked_and_redis_keeps_its_data():
    services = _compose()["services"]
    one_shot = {"bucket", "migrate"}
    unchecked = {"beat", "vllm", "vllm-adapter"}  # beat has no port; vLLM: its own image
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
