"""API tokens: made and revoked on a user's account page, checked on every API request.

A token reads `dbt_<key id>_<secret>`. Only its SHA-256 is stored (the key id finds the row;
the digests are compared in constant time), so the database alone cannot be used to call
the API. It carries its user's roles, as a login does, until it expires or is revoked.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from datamanager.models import ApiToken

PREFIX = "dbt_"
DEFAULT_DAYS = 90
MAX_DAYS = 365
# A token's last use is written at most this often (a request is a read; a write per
# request would contend with the workers' writes on SQLite).
LAST_USED_EVERY = timedelta(minutes=1)


class TokenRefused(Exception):
    """A token that does not let its bearer in; the message says what to do."""


class TokenInvalid(ValueError):
    """A token cannot be made as asked (its name or lifetime); the message says why."""


@dataclass(frozen=True)
class NewToken:
    token: ApiToken
    secret: str  # the whole token: shown to its user once, stored nowhere


def _digest(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def api_token_create(*, user: User, name: str, days: int = DEFAULT_DAYS) -> NewToken:
    """A new token for `user`, valid for `days` days (1 to MAX_DAYS)."""
    name = name.strip()
    if not name or len(name) > 100:
        raise TokenInvalid("give the token a name of 1 to 100 characters (what it is for)")
    if not 1 <= days <= MAX_DAYS:
        raise TokenInvalid(f"a token lives 1 to {MAX_DAYS} days, not {days}")
    key_id = secrets.token_hex(6)
    secret = f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    token = ApiToken.objects.create(
        user=user,
        name=name,
        key_id=key_id,
        digest=_digest(secret),
        expires_at=timezone.now() + timedelta(days=days),
    )
    return NewToken(token=token, secret=secret)


@transaction.atomic
def api_token_revoke(*, token_id: int, user: User) -> ApiToken:
    """Revoke one of `user`'s tokens (ApiToken.DoesNotExist for another user's): every
    request with it is refused from now on."""
    token = ApiToken.objects.select_for_update().get(pk=token_id, user=user)
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token


def api_token_authenticate(*, raw: str) -> ApiToken:
    """The live token `raw` is, with its user; TokenRefused otherwise. An unknown key id and
    a wrong secret get the same answer; only the token's holder learns that it expired or
    was revoked."""
    unknown = TokenRefused(
        "unknown API token: make one on your account page (/account/) and send it as "
        "'Authorization: Bearer dbt_...'"
    )
    key_id = raw[len(PREFIX) :].split("_", 1)[0] if raw.startswith(PREFIX) else ""
    token = (
        ApiToken.objects.select_related("user").filter(key_id=key_id).first() if key_id else None
    )
    if token is None:
        _digest(raw)  # the same work as a known key id
        raise unknown
    if not hmac.compare_digest(_digest(raw), token.digest):
        raise unknown
    now = timezone.now()
    if token.revoked_at is not None:
        raise TokenRefused(f"this API token ({token.name}) was revoked; make a new one")
    if token.expires_at <= now:
        raise TokenRefused(
            f"this API token ({token.name}) expired on {token.expires_at:%Y-%m-%d}; make a "
            "new one on your account page"
        )
    if not token.user.is_active:
        raise TokenRefused("this API token's user is deactivated")
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_EVERY:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token
