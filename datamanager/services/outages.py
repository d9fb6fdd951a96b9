"""Writes of service outages (datamanager.models.ServiceOutage), made by the web's health
probes (dartboard/health.py) when a service goes down and when it is back."""

from __future__ import annotations

from datetime import datetime

from datamanager.models import ServiceOutage


def service_outage_open(*, service: str, started_at: datetime, error: str) -> ServiceOutage:
    """The service is down since `started_at`: its open outage (created once; its error is
    kept up to date)."""
    outage = ServiceOutage.objects.filter(service=service, ended_at=None).first()
    if outage is None:
        return ServiceOutage.objects.create(service=service, started_at=started_at, error=error)
    if outage.error != error:
        ServiceOutage.objects.filter(pk=outage.pk).update(error=error)
        outage.error = error
    return outage


def service_outage_close(
    *, service: str, started_at: datetime, ended_at: datetime, error: str
) -> ServiceOutage:
    """The service is back at `ended_at`: close its open outage, or record the whole of one
    that could not be written while it lasted (the database's own)."""
    outage = ServiceOutage.objects.filter(service=service, ended_at=None).first()
    if outage is None:
        return ServiceOutage.objects.create(
            service=service, started_at=started_at, ended_at=ended_at, error=error
        )
    ServiceOutage.objects.filter(pk=outage.pk).update(ended_at=ended_at)
    outage.ended_at = ended_at
    return outage
