"""The API's reference for the docs (`manage.py docs_reference`): the OpenAPI schema the
server serves at /api/v1/schema/, as docs/reference/openapi.yaml, and a page listing every
endpoint with the role it needs (docs/reference/api.md). tests/test_docs.py fails when either
differs from what the code gives, and tests/api checks the served schema is the published
one."""

from __future__ import annotations

from typing import Any

from drf_spectacular.generators import EndpointEnumerator, SchemaGenerator
from drf_spectacular.renderers import OpenApiYamlRenderer
from rest_framework import permissions

from datamanager.roles import CAN_ADMINISTER, CAN_CONTROL, CAN_CREATE, CAN_CURATE, CAN_VIEW

ROLE = {
    CAN_VIEW: "viewer",
    CAN_CREATE: "operator",
    CAN_CONTROL: "operator",
    CAN_CURATE: "operator",
    CAN_ADMINISTER: "admin",
}


def openapi_schema() -> dict[str, Any]:
    return SchemaGenerator().get_schema(request=None, public=True)


def openapi_yaml() -> str:
    return OpenApiYamlRenderer().render(openapi_schema(), renderer_context={}).decode()


def _role(callback: Any, method: str, operation: dict[str, Any]) -> str:
    if method in permissions.SAFE_METHODS:
        return "viewer"
    if operation.get("operationId") == "trajectories_reward":
        return "admin"
    return ROLE[getattr(callback.cls, "write_permission", CAN_CONTROL)]


def api_page(generated: str) -> str:
    """Every endpoint: method, path, the role it needs, what it does."""
    schema = openapi_schema()
    rows = []
    for path, _, method, callback in EndpointEnumerator().get_api_endpoints():
        operation = schema["paths"].get(path, {}).get(method.lower())
        if operation is None:
            continue  # the schema's own view
        text = (operation.get("description") or "").strip().split("\n\n")[0]
        summary = text.replace("\n", " ").replace("|", "\\|")
        role = _role(callback, method, operation)
        rows.append(f"| `{method}` | `{path}` | {role} | {summary} |")
    return "\n".join(
        [
            "# API reference",
            "",
            generated,
            "",
            "Every endpoint of the REST API (`dartboard/api/`), with the role it needs; "
            "[Script Dartboard](../scripting.md) shows them in use. The whole OpenAPI schema, with "
            "each request and response shape, is [openapi.yaml](openapi.yaml), the same the server "
            "serves at `/api/v1/schema/`. Errors are JSON with `code`, `message`, `field` and "
            "`errors` (every problem found).",
            "",
            "| method | path | role | what it does |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )
