"""Which stored files the web serves: a step's screenshot (an episode's, an uploaded or a
curated demonstration's; every one is stored under screenshots/.../traj-<id>/), to users who
may view runs, through the dashboard's /media/ and the API's /api/v1/screenshots/. Nothing
else in the media storage is served: on S3 the same bucket holds the checkpoints."""

from __future__ import annotations

import re
from typing import IO

from django.core.files.storage import default_storage

from datamanager.selectors.trajectories import screenshot_referenced

_SCREENSHOT_KEY = re.compile(r"screenshots/(?:[A-Za-z0-9_-]+/)*traj-([0-9]+)/[A-Za-z0-9_.-]+")


def screenshot_open(key: str) -> IO[bytes] | None:
    """The screenshot stored under `key`, open for reading; None unless a step has it."""
    found = _SCREENSHOT_KEY.fullmatch(key)
    if found is None or not (
        screenshot_referenced(trajectory_id=int(found[1]), key=key) and default_storage.exists(key)
    ):
        return None
    return default_storage.open(key, "rb")
