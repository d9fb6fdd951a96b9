"""Reads of the services' outage records (`ServiceOutage`), newest first."""

from __future__ import annotations

from datamanager.models import ServiceOutage


def recent_outages(*, limit: int = 10) -> list[ServiceOutage]:
    return list(ServiceOutage.objects.all()[:limit])
