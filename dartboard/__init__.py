"""Dartboard: the Django project and the web dashboard.

- the project: `settings` (read from the environment by `config_env`), `urls`, `asgi` with
  `routing` and `consumers` (the live feed over Channels), `serve` (uvicorn), `celery`;
- the pages, thin interfaces over the data manager's services and selectors: `views`,
  `account_views`, `review_views`, `export_views`, with `forms`, `viewmodels`, `figures`
  and `svg`; `api`: the REST API over the same services;
- around them: `health` (what is up and what is down), `outage` (a database outage
  answered as one), `body_limit`, `login_throttle`, `screenshots` (which stored files the
  web serves), `flower` (the Celery monitor behind the dashboard's login).

May import `datamanager`, the DART modules and `core`; never `hostagent`, nor `workers`
(an action is a service that enqueues Celery work by name; only `celery` wires the worker's
shutdown to `workers.lifecycle`): pyproject.toml's import-linter contracts.
"""

from dartboard.celery import app as celery_app

__all__ = ["celery_app"]
