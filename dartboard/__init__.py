"""Dartboard: the Django project (settings, urls, ASGI, Celery app) and the web dashboard."""

from dartboard.celery import app as celery_app

__all__ = ["celery_app"]
