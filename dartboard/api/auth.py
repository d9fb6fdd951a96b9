"""Who calls the API and what they may do.

A request carries a token from its user's account page (`Authorization: Bearer dbt_...`,
`datamanager.services.tokens`) or, from the dashboard's own pages, the browser's session,
whose writes need the CSRF token as a form's do. Either way the user's roles decide
(`datamanager.roles`): a viewer reads, an operator creates, controls and curates, an admin
also grants what only an admin may. Writes are limited per token (per user for a session)
to DARTBOARD_API_WRITES_PER_MINUTE, but for the tokens DARTBOARD_API_UNLIMITED_TOKENS names.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions, permissions, throttling
from rest_framework.request import Request

from datamanager.models import ApiToken
from datamanager.roles import CAN_ADMINISTER, CAN_CONTROL, CAN_CREATE, CAN_CURATE, CAN_VIEW
from datamanager.services.tokens import TokenRefused, api_token_authenticate

# What each permission lets a user do, for the refusal's message.
WHAT = {
    CAN_VIEW: "read runs (the viewer role)",
    CAN_CREATE: "create runs (the operator role)",
    CAN_CONTROL: "start, pause, resume or stop runs (the operator role)",
    CAN_CURATE: "curate trajectories (the operator role)",
    CAN_ADMINISTER: "do this (the admin role)",
}


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer dbt_...`: the token's user, with the token as `request.auth`."""

    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, ApiToken] | None:
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if not header:
            return None
        scheme, _, raw = header.partition(" ")
        if scheme.lower() != "bearer" or not raw.strip():
            raise exceptions.AuthenticationFailed(
                "send the token as 'Authorization: Bearer dbt_...'"
            )
        try:
            token = api_token_authenticate(raw=raw.strip())
        except TokenRefused as exc:
            raise exceptions.AuthenticationFailed(str(exc)) from None
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="dartboard"'


class SessionWithCsrfAuthentication(authentication.SessionAuthentication):
    """The dashboard's login, for its own pages' calls: DRF's session check, CSRF included."""


class RolePermission(permissions.BasePermission):
    """A read needs CAN_VIEW; a write the view's `write_permission` (CAN_CONTROL unless it
    says otherwise)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        user = request.user
        if user is None or not user.is_authenticated:
            raise exceptions.NotAuthenticated(
                "no credentials: send a token from your account page as "
                "'Authorization: Bearer dbt_...'"
            )
        needed = (
            CAN_VIEW
            if request.method in permissions.SAFE_METHODS
            else getattr(view, "write_permission", CAN_CONTROL)
        )
        if not user.has_perm(needed):
            raise exceptions.PermissionDenied(
                f"{user.get_username()} may not {WHAT.get(needed, 'do this')}"
            )
        return True


class WriteThrottle(throttling.SimpleRateThrottle):
    """Writes per token (per user for a session) per minute; reads are not limited, nor are
    the writes of a token DARTBOARD_API_UNLIMITED_TOKENS names (read per request)."""

    scope = "writes"

    def get_cache_key(self, request: Request, view: Any) -> str | None:
        if request.method in permissions.SAFE_METHODS or request.user is None:
            return None
        if isinstance(request.auth, ApiToken):
            if request.auth.key_id in settings.DARTBOARD_API_UNLIMITED_TOKENS:
                return None
            ident = f"token-{request.auth.pk}"
        else:
            ident = f"user-{request.user.pk}"
        return self.cache_format % {"scope": self.scope, "ident": ident}


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """The schema's security scheme for API tokens."""

    target_class = BearerTokenAuthentication
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A token from your account page (/account/): dbt_...",
        }


class SessionScheme(OpenApiAuthenticationExtension):
    """The dashboard's session cookie (its pages' own calls; writes need the CSRF token)."""

    target_class = SessionWithCsrfAuthentication
    name = "cookieAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {"type": "apiKey", "in": "cookie", "name": "sessionid"}
