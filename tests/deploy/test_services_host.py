"""The services host's compose override (deploy/compose-services-host.yml) on top of
docker-compose.yml, read as compose merges them (a service's environment by key, its ports
added, its command and networks as given): no container runtime runs here, so what is
checked is what the two files say.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SHARED = {"postgres": 5432, "redis": 6379, "minio": 9000}


def _files() -> tuple[dict[str, Any], dict[str, Any]]:
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    override = yaml.safe_load((ROOT / "deploy" / "compose-services-host.yml").read_text())
    return base, override


def _substitute(value: str, given: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR:?message}, with `given` for the variables set."""

    def one(match: re.Match) -> str:
        name, op, rest = match.groups()
        if name in given:
            return given[name]
        assert op == ":-", f"${{{name}}} is required ({rest}) and the test gives no value"
        return rest

    return re.sub(r"\$\{([A-Z_]+)(:[-?])([^}]*)\}", one, str(value))


def test_only_the_shared_services_are_published_on_the_private_address_with_passwords():
    base, override = _files()
    services = override["services"]
    assert set(services) <= set(base["services"])
    published = {n: s["ports"] for n, s in services.items() if s.get("ports")}
    assert published == {
        n: [f"${{DARTBOARD_PRIVATE_ADDRESS:?set DARTBOARD_PRIVATE_ADDRESS}}:{p}:{p}"]
        for n, p in SHARED.items()
    }
    # None keeps compose's default password once the port is published.
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith(
        "${POSTGRES_PASSWORD:?"
    )
    minio = services["minio"]["environment"]
    assert minio["MINIO_ROOT_PASSWORD"].startswith("${AWS_SECRET_ACCESS_KEY:?")
    redis = services["redis"]["command"]
    assert redis[redis.index("--requirepass") + 1] == "${REDIS_PASSWORD:?set REDIS_PASSWORD}"
    assert services["redis"]["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD:?")
    assert base["services"]["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert redis[: redis.index("--requirepass")] == base["services"]["redis"]["command"]
    # The private network has a route out; the rest stays on compose's internal one.
    assert override["networks"] == {"private": {}}
    for name, svc in services.items():
        assert "public" not in svc.get("networks", []), name
    assert "private" in services["web"]["networks"]


def test_every_django_service_reaches_redis_with_the_password_and_loads_its_settings(tmp_path):
    """Every service that holds REDIS_URL in docker-compose.yml gets the one with the
    password; the web's merged environment loads the settings in production."""
    base, override = _files()
    for name, svc in base["services"].items():
        if "REDIS_URL" in (svc.get("environment") or {}):
            env = override["services"].get(name, {}).get("environment", {})
            assert env.get("REDIS_URL", "").startswith("redis://:${REDIS_PASSWORD:?"), name
            assert env.get("DARTBOARD_PROCESSES") == "per-run", name
    given = {"SECRET_KEY": "s" * 50, "DARTBOARD_SERVICE_TOKEN": "t" * 40,
             "DARTBOARD_INFERENCE_TOKEN": "i" * 40, "DARTBOARD_ADMIN_TOKEN": "a" * 40,
             "FLOWER_BASIC_AUTH": "ops:" + "f" * 24, "POSTGRES_PASSWORD": "p" * 32,
             "REDIS_PASSWORD": "r" * 32}  # fmt: skip
    merged = {
        **base["services"]["web"]["environment"],
        **override["services"]["web"]["environment"],
    }
    env = {k: _substitute(v, given) for k, v in merged.items()}
    env["DARTBOARD_HOME"] = str(tmp_path)
    probe = (
        "import json; from django.conf import settings as s; "
        "print(json.dumps([s.PRODUCTION, s.REDIS_URL, s.DATABASES['default']['PASSWORD'], "
        "s.DARTBOARD_PROCESSES]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "DJANGO_SETTINGS_MODULE": "dartboard.settings", **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    production, redis, db_password, processes = json.loads(done.stdout.splitlines()[-1])
    assert production and redis == f"redis://:{'r' * 32}@redis:6379/0"
    assert db_password == "p" * 32 and processes == "per-run"
