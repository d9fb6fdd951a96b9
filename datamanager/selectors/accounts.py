"""Reads for a user's account page and for sweeps: API tokens, sweeps with their members."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from datamanager.models import ApiToken, Sweep


def api_tokens(*, user: Any) -> QuerySet[ApiToken]:
    """A user's API tokens, newest first (revoked and expired ones too: the page says so)."""
    return ApiToken.objects.filter(user=user).order_by("-created_at")


def sweeps_listing() -> QuerySet[Sweep]:
    """Sweeps with their owner and member runs, as the sweeps page and the API list them."""
    return Sweep.objects.select_related("owner").prefetch_related("members__run")


def sweep_find(*, sweep_id: int) -> Sweep | None:
    return Sweep.objects.select_related("owner").filter(pk=sweep_id).first()
