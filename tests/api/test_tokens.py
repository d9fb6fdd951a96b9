"""Tokens: made on the account page and shown once, stored hashed, refused once expired or
revoked; roles as a login's; writes limited per token."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from datamanager.models import ApiToken, Run
from tests.api.conftest import problem_of
from tests.dartboard.test_browser import running_web


def test_a_token_is_made_on_the_account_page_shown_once_and_revoked_there(api_url, api, ada_client):
    forever = ada_client.post("/account/", {"name": "forever", "days": "100000"})
    assert forever.status_code == 400 and not ApiToken.objects.exists()
    page = ada_client.post("/account/", {"name": "laptop notebook", "days": "30"})
    assert page.status_code == 200 and page["Cache-Control"] == "no-store"
    secret = page.context["created"].secret
    assert secret.startswith("dbt_") and secret in page.content.decode()
    stored = ApiToken.objects.get(name="laptop notebook")
    assert stored.digest == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in str(ApiToken.objects.values())  # only its hash is kept
    assert secret not in ada_client.get("/account/").content.decode()  # never shown again
    assert 29 <= (stored.expires_at - timezone.now()).days <= 30

    with httpx.Client(
        base_url=f"{api_url}/api/v1/", headers={"Authorization": f"Bearer {secret}"}
    ) as laptop:
        me = laptop.get("me/").json()
        assert me == {
            "username": "ada",
            "roles": ["operator"],
            "may": ["view", "create", "control", "curate"],
        }
        ada_client.post(f"/account/tokens/{stored.pk}/revoke/")
        refused = laptop.get("me/")
    assert problem_of(refused)[:2] == (401, "not_authenticated")
    assert "revoked" in refused.json()["message"]
    assert refused.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    ["Bearer dbt_000000000000_guess", "Bearer nothing", "Token abc", "Bearer", "Basic YWRhOnB3"],
)
def test_an_unknown_or_malformed_token_is_refused(api_url, transactional_db, header):
    response = httpx.get(f"{api_url}/api/v1/runs/", headers={"Authorization": header})
    assert problem_of(response)[:2] == (401, "not_authenticated")


def test_an_expired_token_says_so_and_a_wrong_secret_for_a_real_key_is_unknown(api, api_url):
    ada = api("ada")
    secret = ada.headers["Authorization"].removeprefix("Bearer ")
    forged = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    unknown = httpx.get(f"{api_url}/api/v1/me/", headers={"Authorization": f"Bearer {forged}"})
    assert "unknown API token" in unknown.json()["message"]
    ApiToken.objects.update(expires_at=timezone.now() - timedelta(minutes=1))
    expired = ada.get("me/")
    assert problem_of(expired)[:2] == (401, "not_authenticated")
    assert "expired on" in expired.json()["message"]


def test_no_credentials_is_401_not_a_login_redirect(api):
    anonymous = api(None)
    for response in (anonymous.get("runs/"), anonymous.post("runs/", json={"name": "x"})):
        assert problem_of(response)[:2] == (401, "not_authenticated")
    assert not Run.objects.exists()


def test_writes_are_limited_per_token_and_reads_are_not(subprocess_env, django_user_model):
    from datamanager.roles import role_group
    from datamanager.services.tokens import api_token_create

    ada = django_user_model.objects.create_user("ada")
    ada.groups.add(role_group("operator"))
    first, second = (api_token_create(user=ada, name=n).secret for n in ("a", "b"))
    env = {**subprocess_env, "DARTBOARD_API_WRITES_PER_MINUTE": "3"}
    with running_web(env) as url:
        one = httpx.Client(base_url=f"{url}/api/v1/", headers={"Authorization": f"Bearer {first}"})
        body = {"name": "r", "config": {"policy": "oracle"}}
        codes = [one.post("runs/", json=body).status_code for _ in range(4)]
        assert codes == [201, 201, 201, 429]
        limited = one.post("runs/", json=body)
        assert problem_of(limited)[:2] == (429, "throttled")
        assert int(limited.headers["Retry-After"]) > 0
        assert one.get("runs/").json()["count"] == 3  # reads go on
        other = httpx.post(
            f"{url}/api/v1/runs/", json=body, headers={"Authorization": f"Bearer {second}"}
        )
        assert other.status_code == 201  # the limit is per token
        one.close()
    assert Run.objects.count() == 4


def test_a_token_the_setting_names_writes_past_the_limit_and_the_others_do_not(
    db, django_user_model, settings, monkeypatch
):
    """DARTBOARD_API_UNLIMITED_TOKENS, read per request: the token it names is not limited,
    another of the same user still is (here, in this process, at 2 writes a minute)."""
    from django.core.cache import cache
    from django.test import Client

    from dartboard.api.auth import WriteThrottle
    from datamanager.services.tokens import api_token_create
    from tests.conftest import user_in_role

    monkeypatch.setattr(WriteThrottle, "rate", "2/min", raising=False)
    ada = user_in_role(django_user_model, "ada", "operator")
    named, other = (api_token_create(user=ada, name=name) for name in ("bulk import", "laptop"))
    settings.DARTBOARD_API_UNLIMITED_TOKENS = [named.token.key_id]

    def stops(token) -> list[int]:  # writes: of a run that is not there, so 404 unless limited
        client = Client(headers={"Authorization": f"Bearer {token.secret}"})
        return [client.post("/api/v1/runs/999999/stop/").status_code for _ in range(3)]

    cache.clear()  # the limit's counts, kept by token id: an earlier test's token had this id
    try:
        assert stops(named) == [404, 404, 404]
        assert stops(other) == [404, 404, 429]
    finally:
        cache.clear()
