"""The API's tests: the web server serving the test database for the whole session (the API
as a deployment serves it, body limit included), and people with tokens, each an httpx
client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import subprocess_environ, user_in_role
from tests.dartboard.test_browser import running_web
from tests.helpers import needs


@pytest.fixture(scope="session")
@needs("live")
def api_url(django_db_setup, django_db_blocker) -> Iterator[str]:
    """The URL of the web server on the test database, for the session."""
    env = {**subprocess_environ(), "DARTBOARD_API_WRITES_PER_MINUTE": "100000"}
    # Its first request loads the API's URLconf and schema code: on a loaded 2-core machine
    # that took over 30 s.
    with running_web(env, timeout=120) as url:
        yield url


@pytest.fixture
def api(api_url, transactional_db, django_user_model) -> Callable[..., httpx.Client]:
    """api(name, role) -> an httpx client of the live server that sends a new token of a
    new user `name` in `role` (viewer, operator, admin); api(None) sends no token."""
    from datamanager.services.tokens import api_token_create

    clients: list[httpx.Client] = []

    def make(name: str | None = "ada", role: str = "operator", **kwargs: Any) -> httpx.Client:
        headers = {}
        if name is not None:
            user = django_user_model.objects.filter(username=name).first()
            user = user or user_in_role(django_user_model, name, role)
            headers["Authorization"] = f"Bearer {api_token_create(user=user, name='tests').secret}"
        client = httpx.Client(base_url=f"{api_url}/api/v1/", headers=headers, timeout=60, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def problem_of(response: httpx.Response) -> tuple[int, str, str | None]:
    """(status, code, field) of a refusal, after checking its JSON shape."""
    body = response.json()
    assert set(body) == {"code", "message", "field", "errors"}, body
    assert body["errors"][0] == {k: body[k] for k in ("code", "message", "field")}
    assert body["message"]
    return response.status_code, body["code"], body["field"]
