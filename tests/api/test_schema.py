"""The API's schema: the server serves what the docs publish, it is valid OpenAPI, the API
holds to it under fuzzing (schemathesis, bounded: every operation, schema-valid requests
taken and schema-invalid ones refused), and a client generated from it by a standard
generator (openapi-python-client) creates and starts a run."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import requests
import yaml
from django.test import Client
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings

from datamanager.models import Run, RunStatus, Task
from tests.conftest import user_in_role
from tests.dartboard.run_helpers import make_run
from tests.dartboard.test_curation_views import finished

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "docs" / "reference" / "openapi.yaml"
FUZZ_EXAMPLES = 3  # random cases per operation and mode, after the coverage cases
# schemathesis is imported where it is used: a third of a second for every collection of
# this module otherwise (start-up cost).


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


def test_the_schema_says_no_string_a_request_sends_holds_a_nul():
    """Every string a request sends (a query parameter, a body's property) without an enum
    or a format of its own has the pattern that rules a NUL out: the server refuses one in
    each (the fuzz test's coverage cases send one), and random cases seldom draw one."""
    from dartboard.api.reference import openapi_schema
    from dartboard.api.schemas import NO_NUL

    schema = openapi_schema()
    strings: list[tuple[str, dict]] = []

    def walk(node, where: str) -> None:
        if isinstance(node, dict):
            free = node.get("type") == "string" and not {"enum", "format"} & set(node)
            # maxLength 0: the "" that a blank-allowed string's oneOf adds.
            if free and node.get("maxLength") != 0:
                strings.append((where, node))
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for value in node:
                walk(value, where)

    for path, item in schema["paths"].items():
        for method, operation in item.items():
            for parameter in operation.get("parameters", []):
                if parameter["in"] == "query":
                    walk(parameter["schema"], f"{method} {path}?{parameter['name']}")
    for name, component in schema["components"]["schemas"].items():
        if name.endswith("Request"):  # COMPONENT_SPLIT_REQUEST: what a request sends
            walk(component, name)
    assert len(strings) >= 10, strings
    assert [where for where, node in strings if node.get("pattern") != NO_NUL] == []


# The API's rules no OpenAPI schema can state, each where it applies: a run's settings are
# `run_config_validate`'s to judge (`RunConfig`'s own rules, the tasks that exist, the user's
# role), refused as `invalid_config`; a filter's range is refused upside down.
CONFIG_JUDGED = {"runs_create", "runs_copy", "sweeps_create"}
RANGES = [
    ("reward_min", "reward_max"),
    ("entropy_min", "entropy_max"),
    ("is_weight_min", "is_weight_max"),
    ("finished_from", "finished_to"),
]


def upside_down(query: dict) -> bool:
    """Whether a filter range of the query is upside down (TrajectoryFilterForm.clean)."""
    for low, high in RANGES:
        if low in query and high in query:
            parse = datetime.fromisoformat if low == "finished_from" else float
            if parse(str(query[low])) > parse(str(query[high])):
                return True
    return False


def accepted(ctx, response, case) -> None:
    """schemathesis's positive_data_acceptance, but for the refusals the schema cannot
    state: a run's settings judged invalid, a filter range upside down."""
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    if response.status_code == 400 and case.meta.generation.mode.is_positive:
        codes = {p["code"] for p in response.json()["errors"]}
        operation_id = case.operation.definition.raw["operationId"]
        if operation_id in CONFIG_JUDGED and codes == {"invalid_config"}:
            return None
        if upside_down(case.query or {}):
            return None
    return positive_data_acceptance(ctx, response, case)


def answer_in_process(client: Client, case, headers: dict[str, str]):
    """The case sent through Django's test client (in this process, where the `settings`
    fixture applies), answered as schemathesis's Response."""
    from schemathesis.core.transport import Response

    kwargs = case.as_transport_kwargs(base_url="http://testserver", headers=headers)
    kwargs.pop("cookies", None)  # a generated session cookie: the token is what signs in
    sent = requests.Request(**kwargs).prepare()
    body = sent.body.encode() if isinstance(sent.body, str) else sent.body or b""
    sent_headers = {
        k: v for k, v in sent.headers.items() if k.lower() not in ("content-type", "content-length")
    }
    started = time.monotonic()
    got = client.generic(
        sent.method,
        sent.url.removeprefix("http://testserver"),
        data=body,
        content_type=sent.headers.get("Content-Type", ""),
        headers=sent_headers,
    )
    content = b"".join(got.streaming_content) if got.streaming else got.content
    return Response(
        status_code=got.status_code,
        headers={k: [v] for k, v in got.headers.items()},
        content=content,
        request=sent,
        elapsed=time.monotonic() - started,
        verify=True,
    )


@pytest.mark.slow
def test_the_api_holds_to_its_schema_under_fuzzing(transactional_db, django_user_model, settings):
    """Requests made from the served schema against every operation, as an operator whose
    token the write limit does not apply to (DARTBOARD_API_UNLIMITED_TOKENS), with a run, a
    trajectory and its steps to find: no 5xx; every status, content type and body as the
    schema documents; every schema-valid request taken (2xx, or 403, 404, 409: a role, a row,
    a state) and every schema-invalid one refused. So the schema states every bound the
    server enforces. First each bound from both sides (schemathesis's coverage cases), then
    random requests (FUZZ_EXAMPLES per operation, valid and not)."""
    import schemathesis
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.config import SchemathesisConfig
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    from datamanager.services.tokens import api_token_create

    client = Client()
    served = yaml.safe_load(client.get("/api/v1/schema/").content)
    token = api_token_create(user=user_in_role(django_user_model, "ada", "operator"), name="fuzz")
    settings.DARTBOARD_API_UNLIMITED_TOKENS = [token.token.key_id]
    finished(make_run(policy="oracle"))
    # 429 is not among them: the token's writes are not limited.
    taken = {"expected-statuses": ["2xx", "403", "404", "409"]}
    config = SchemathesisConfig.from_dict({"checks": {"positive_data_acceptance": taken}})
    schema = schemathesis.openapi.from_dict(served, config=config)
    # The coverage cases' copy takes a run's settings as any object: RunConfig's rules are
    # `run_config_validate`'s, and each of its settings' bounds made thousands of cases.
    opaque = copy.deepcopy(served)
    opaque["components"]["schemas"]["RunConfig"] = {"type": "object"}
    opaque_schema = schemathesis.openapi.from_dict(opaque, config=config)
    headers = {"Authorization": f"Bearer {token.secret}"}
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        accepted,
        negative_data_rejection,
    ]
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    started, calls, failures = time.monotonic(), 0, []

    def send(case) -> None:
        nonlocal calls
        calls += 1
        case.validate_response(answer_in_process(client, case, headers), checks=checks)

    for result in opaque_schema.get_all_operations():
        operation = result.ok()
        generation = opaque_schema.config.generation_for(operation=operation, phase="coverage")
        cases = opaque_schema.iter_coverage_cases(
            operation, generation_modes=modes, generation_config=generation
        )
        try:
            for case in cases:
                # A YAML body is parsed into what its JSON twin is (the random cases send both).
                if case.media_type != "application/yaml":
                    send(case)
        except (AssertionError, BaseExceptionGroup) as exc:  # schemathesis's FailureGroup
            failures.append(f"{operation.label} (coverage): {exc}")

    def fuzz(operation, mode) -> None:
        # No deadline (no wall-clock bound on a shared machine) and no shrinking: the
        # examples bound the time, and a failure is reported as found.
        @given(case=operation.as_strategy(generation_mode=mode))
        @hsettings(
            max_examples=FUZZ_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
        )
        def check(case):
            send(case)

        try:
            check()
        except (AssertionError, BaseExceptionGroup) as exc:
            failures.append(f"{operation.label} ({mode.value}): {exc}")

    for result in schema.get_all_operations():
        for mode in modes:
            fuzz(result.ok(), mode)
    elapsed = time.monotonic() - started
    print(f"sent {calls} requests over {len(served['paths'])} paths in {elapsed:.1f} s")
    assert not failures, "\n\n".join(failures)


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
