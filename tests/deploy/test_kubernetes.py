"""The Kubernetes manifests (deploy/kubernetes/) hold together without a cluster.

Every document is validated against the Kubernetes API's own schemas (kubernetes-validate's
strict ones: an unknown field fails too) offline, for the oldest and the newest release named
below; `kubectl apply --dry-run=client` would need an API server. Then what a user would
check: every name a document refers to exists (Secrets, ConfigMap keys, Services and their
ports, the Ingress's backend), the secrets are placeholders that stop the platform until they
are filled, each Django process loads its settings in production mode from exactly what the
manifests give it, the containers run compose's image and commands, and the host agent runs
on every GPU node with all its GPUs at the node's own address.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.30", "1.37")  # the oldest and the newest release the manifests are valid for
PLACEHOLDER = "CHANGE_ME"
DJANGO = ("web", "worker-default", "beat", "flower", "agent")  # the workloads running Django


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]


@functools.cache  # read once; nothing here changes a document
def manifests() -> list[dict[str, Any]]:
    return documents("dartboard.yaml") + documents("secret.yaml")


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def workloads() -> dict[str, dict[str, Any]]:
    kinds = ("Deployment", "StatefulSet", "DaemonSet", "Job")
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] in kinds}


def containers(workload: dict[str, Any], *, init: bool = True) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return [*(spec.get("initContainers", []) if init else []), *spec["containers"]]


def labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"].get("metadata", {}).get("labels", {})


def main_container(name: str) -> dict[str, Any]:
    return containers(workloads()[name], init=False)[0]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_document_is_valid_against_the_kubernetes_schemas(version):
    problems = []
    for doc in manifests():
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(map(str, exc.path))
            problems.append(f"{where}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{where}: {exc.message}")
    assert not problems, f"against Kubernetes {version}:\n" + "\n".join(problems)


def test_everything_lives_in_the_namespace_the_manifest_makes():
    (namespace,) = by_kind("Namespace")
    for doc in manifests():
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, doc["metadata"]["name"]


def test_every_secret_is_a_placeholder_never_a_value():
    """The Secrets hold placeholders only (stringData, no base64 `data`); what is left of a
    value without its placeholders is no secret (a URL's shape, a user name)."""
    secret_docs = by_kind("Secret")
    assert secret_docs and all(d["kind"] == "Secret" for d in documents("secret.yaml"))
    assert not [d for d in documents("dartboard.yaml") if d["kind"] == "Secret"]
    for name, doc in secret_docs.items():
        assert "data" not in doc, f"{name}: literal base64 data"
        for key, value in doc["stringData"].items():
            assert PLACEHOLDER in value, f"{name}.{key}: {value!r} is no placeholder"
            rest = value.replace(PLACEHOLDER, "")
            assert not re.search(r"[A-Za-z0-9_-]{12,}", rest), f"{name}.{key}: {value!r}"


def _filled() -> dict[str, dict[str, str]]:
    """Each Secret as the fill command in secret.yaml's header makes it."""
    header = (KUBE / "secret.yaml").read_text()
    assert 're.sub("CHANGE_ME", lambda _: secrets.token_hex(20)' in header
    return {
        name: {k: v.replace(PLACEHOLDER, secrets.token_hex(20)) for k, v in d["stringData"].items()}
        for name, d in by_kind("Secret").items()
    }


def test_every_name_a_document_refers_to_exists():
    config = {n: d["data"] for n, d in by_kind("ConfigMap").items()}
    secret = {n: d["stringData"] for n, d in by_kind("Secret").items()}
    known = {"configMapKeyRef": config, "secretKeyRef": secret}
    wrong = []
    for name, workload in workloads().items():
        for c in containers(workload):
            for source in c.get("envFrom", []):
                ((kind, ref),) = source.items()
                objects = config if kind == "configMapRef" else secret
                if ref["name"] not in objects:
                    wrong.append(f"{name}/{c['name']}: no {kind} {ref['name']}")
            for var in c.get("env", []):
                for kind, ref in var.get("valueFrom", {}).items():
                    if kind in known and ref["key"] not in known[kind].get(ref["name"], {}):
                        wrong.append(f"{name}/{c['name']}: {var['name']}: no {ref}")
        governing = workload["spec"].get("serviceName")
        if workload["kind"] == "StatefulSet" and governing not in by_kind("Service"):
            wrong.append(f"{name}: no Service {workload['spec']['serviceName']}")
    assert not wrong, "\n".join(wrong)


def _ports(name: str) -> dict[str | int, int]:
    """A Service's ports (by name and number) -> the container port each reaches, checked
    against the containers its selector picks."""
    service = by_kind("Service")[name]
    selector = service["spec"]["selector"].items()
    selected = [w for w in workloads().values() if selector <= labels(w).items()]
    assert len(selected) == 1, f"Service {name} selects {[w['metadata']['name'] for w in selected]}"
    offered = {
        p["name"]: p["containerPort"] for c in containers(selected[0]) for p in c.get("ports", [])
    }
    out = {}
    for port in service["spec"]["ports"]:
        target = port["targetPort"]
        assert target in offered or target in offered.values(), (
            f"{name}: no container port {target}"
        )
        out[port["name"]] = out[port["port"]] = offered.get(target, target)
    return out


def test_every_service_and_the_ingress_reach_a_container_port():
    for name in by_kind("Service"):
        _ports(name)
    (ingress,) = by_kind("Ingress").values()
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            (port,) = backend["port"].values()
            assert port in _ports(backend["name"]), backend
    # The names the ConfigMap gives the Django processes are these Services' ports.
    env = by_kind("ConfigMap")["dartboard-env"]["data"]
    assert _ports("postgres")[5432] == 5432 and "@postgres:5432/" in env["DATABASE_URL"]
    assert env["AWS_S3_ENDPOINT_URL"] == f"http://minio:{_ports('minio')['s3']}"
    assert env["DARTBOARD_FLOWER_URL"] == "http://flower:5555" and _ports("flower")[5555] == 5555
    redis_url = by_kind("Secret")["dartboard-secrets"]["stringData"]["REDIS_URL"]
    assert redis_url.endswith(f"@redis:{_ports('redis')['redis']}/0")
    assert _ports("web")["http"] == 8000


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_the_containers_run_composes_image_and_commands():
    """The same image as docker-compose.yml, and its web, worker, beat and Flower commands
    (checked against the code by tests/test_layout.py); the others run real commands."""
    from django.core.management import get_commands

    compose = _compose()
    image = compose["web"]["image"]
    for name in DJANGO:
        for c in containers(workloads()[name]):
            assert c["image"] == image, f"{name}/{c['name']}: {c['image']}"
    for name in ("web", "worker-default", "beat", "flower"):
        assert main_container(name)["command"] == compose[name]["command"], name
    commands = [c["command"] for n in DJANGO for c in containers(workloads()[n])]
    for command in commands:
        text = " ".join(command)
        for m in re.finditer(r"manage\.py (\w+)", text):
            assert m.group(1) in get_commands(), text
    for name in ("postgres", "redis", "minio"):
        assert main_container(name)["image"].split(":")[0] == compose[name]["image"].split(":")[0]


def _settings_seen(env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    """What the settings module makes of exactly `env`, in a fresh Python."""
    probe = (
        "import json; from django.conf import settings as s; s.DEBUG; "
        "print(json.dumps({'production': s.PRODUCTION, 'db': s.DATABASES['default']['HOST'], "
        "'db_password': s.DATABASES['default']['PASSWORD'], 'redis': s.REDIS_URL, "
        "'artifacts': s.DARTBOARD_ARTIFACTS, 'media': s.STORAGES['default']['BACKEND'], "
        "'processes': s.DARTBOARD_PROCESSES, 'address': s.DARTBOARD_HOST_ADDRESS, "
        "'proxy': list(s.SECURE_PROXY_SSL_HEADER or ())}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={
            "PATH": os.environ["PATH"],
            "DJANGO_SETTINGS_MODULE": "dartboard.settings",
            "DARTBOARD_HOME": str(tmp_path),
            **env,
        },
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.splitlines()[-1])


def container_env(name: str, secret: dict[str, dict[str, str]]) -> dict[str, str]:
    """The environment a workload's main container starts with: its envFrom, then its env
    (the downward API's fields as a node would give them)."""
    c = main_container(name)
    config = {n: d["data"] for n, d in by_kind("ConfigMap").items()}
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        ((kind, ref),) = source.items()
        env.update((config if kind == "configMapRef" else secret)[ref["name"]])
    fields = {"spec.nodeName": "gpu-node-1", "status.hostIP": "10.0.0.7"}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ((kind, ref),) = var["valueFrom"].items()
        if kind == "fieldRef":
            env[var["name"]] = fields[ref["fieldPath"]]
        else:
            env[var["name"]] = (config if kind == "configMapKeyRef" else secret)[ref["name"]][
                ref["key"]
            ]
    return env


def test_every_django_process_loads_its_settings_in_production_from_the_manifests(tmp_path):
    """With the secrets filled, the web and a host agent (the workers, beat and Flower get
    the web's environment) load the settings in production mode, reaching PostgreSQL, Redis
    and the bucket by their Services; with a placeholder left, they refuse to start."""
    filled = _filled()
    envs = {name: container_env(name, filled) for name in DJANGO}
    flower = {"FLOWER_BASIC_AUTH"}
    for name in ("worker-default", "beat"):
        assert envs[name] == {k: v for k, v in envs["web"].items() if k not in flower}, name
    assert envs["flower"] == envs["web"]
    web = _settings_seen(envs["web"], tmp_path)
    assert web == {
        "production": True, "db": "postgres", "db_password": "", "redis": envs["web"]["REDIS_URL"],
        "artifacts": "s3://dartboard/artifacts", "media": "storages.backends.s3.S3Storage",
        "processes": "per-run", "address": "127.0.0.1", "proxy": ["HTTP_X_FORWARDED_PROTO", "https"],
    }  # fmt: skip
    # libpq reads PostgreSQL's password from PGPASSWORD: the same as the postgres container's.
    postgres = {v["name"]: v for v in main_container("postgres")["env"]}
    assert postgres["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "PGPASSWORD"
    assert envs["web"]["PGPASSWORD"]
    agent = _settings_seen(envs["agent"], tmp_path)
    assert {**web, "address": "10.0.0.7"} == agent
    placeholders = {n: dict(d["stringData"]) for n, d in by_kind("Secret").items()}
    refused = _settings_seen(container_env("web", placeholders), tmp_path)
    assert "SECRET_KEY" in refused["error"], refused


def test_the_agent_runs_on_every_gpu_node_with_all_its_gpus_at_the_nodes_address():
    agent = workloads()["agent"]
    assert agent["kind"] == "DaemonSet"  # one per node
    pod = agent["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    c = main_container("agent")
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    env = {v["name"]: v for v in c["env"]}
    # Its runs listen on the node's address, which stays the node's when the pod is recreated.
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert env["DARTBOARD_HOST_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    # Named after its node, so the next agent there brings back the runs placed on it.
    assert c["command"] == ["python", "manage.py", "host_agent", "--name", "$(NODE_NAME)"]
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Time to stop the runs' processes (an episode or an update may take up to 60 s).
    assert pod["terminationGracePeriodSeconds"] >= 90
    (home,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/var/lib/dartboard"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "hostPath" in volumes[home["name"]]  # on the node's disk
