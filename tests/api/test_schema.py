"""The API's schema: the server serves what the docs publish, it is valid OpenAPI, the API
holds to it under fuzzing (schemathesis, bounded), and a client generated from it by a
standard generator (openapi-python-client) creates and starts a run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from datamanager.models import Run, RunStatus, Task
from tests.dartboard.run_helpers import make_run
from tests.dartboard.test_curation_views import finished

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "docs" / "reference" / "openapi.yaml"
FUZZ_EXAMPLES = 12  # per operation and mode: ~30 operations x 2 modes, about 30 s here


@pytest.fixture
def served(api_url) -> dict:
    response = httpx.get(f"{api_url}/api/v1/schema/")
    assert response.status_code == 200
    return yaml.safe_load(response.text)


def test_the_served_schema_is_the_published_one_and_valid_openapi(served):
    from openapi_spec_validator import validate

    assert served == yaml.safe_load(PUBLISHED.read_text()), (
        "docs/reference/openapi.yaml is out of date: run `.venv/bin/python manage.py docs_reference`"
    )
    validate(served)
    assert served["info"]["version"] == "1"
    assert served["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


def test_the_api_holds_to_its_schema_under_fuzzing(api, api_url, served):
    """Schema-valid and schema-invalid requests against every operation, as an operator
    with a run, a trajectory and its steps to find: no 5xx, every status and body as the
    schema documents, and schema-invalid input refused."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    ada = api("ada")
    run = make_run(policy="oracle")
    finished(run)
    schema = schemathesis.openapi.from_dict(served)
    headers = {"Authorization": ada.headers["Authorization"]}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]  # fmt: skip
    started, calls = time.monotonic(), 0

    def fuzz(operation, mode) -> None:
        mode_checks = checks + (
            [negative_data_rejection] if mode == GenerationMode.NEGATIVE else []
        )

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), derandomize=True)  # fmt: skip
        def check(case):
            nonlocal calls
            calls += 1
            response = case.call(base_url=api_url, headers=headers)
            case.validate_response(response, checks=mode_checks)

        check()

    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(result.ok(), mode)
    elapsed = time.monotonic() - started
    print(f"fuzzed {calls} requests over {len(served['paths'])} paths in {elapsed:.1f} s")
    assert calls >= len(served["paths"]) * 2


def test_a_generated_client_creates_and_starts_a_run(api, api_url, tmp_path, served):
    Task.objects.create(name="click-button", env_kind="miniwob", instruction="click")
    ada = api("ada")
    (tmp_path / "schema.yaml").write_text(yaml.safe_dump(served))
    generated = subprocess.run(
        [str(Path(sys.executable).parent / "openapi-python-client"), "generate", "--path",
         "schema.yaml", "--meta", "none", "--output-path", "dartboard_api"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert generated.returncode == 0, generated.stdout + generated.stderr
    script = f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
from dartboard_api import AuthenticatedClient
from dartboard_api.api.runs import runs_create, runs_start
from dartboard_api.models import RunConfig, RunCreateRequest

client = AuthenticatedClient(base_url={api_url!r}, token={ada.headers["Authorization"].removeprefix("Bearer ")!r})
config = RunConfig.from_dict({{"policy": "oracle", "env": {{"miniwob_slots": 1}}}})
made = runs_create.sync(client=client, body=RunCreateRequest(name="generated", config=config))
started = runs_start.sync(run_id=made.id, client=client)
print(made.id, started.status)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    run_id, status = out.stdout.split()
    assert status == "running"
    run = Run.objects.get(pk=int(run_id))
    assert (run.name, run.status, run.owner.username) == ("generated", RunStatus.RUNNING, "ada")
