"""An uploaded .zip of demonstrations: its size limit, opening it, and the one error every
import raises. What the zip holds is read by `datamanager.demos` (Dartboard's manifest,
OSWorld result folders, AgentNet lines); `datamanager.services.demos` imports it.
"""

from __future__ import annotations

import zipfile
from typing import IO

from datamanager.demos.episodes import DemoFileError, ZipFiles

MAX_UPLOAD_BYTES = 256 * 1024 * 1024  # the .zip itself


class InvalidUpload(ValueError):
    """The demonstrations are not importable. `errors` lists every problem ("file: field: why")."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors


def archive_open(fileobj: IO[bytes]) -> ZipFiles:
    """The upload as a source of demonstration files; InvalidUpload when it is not a usable
    .zip (unreadable, or a member named outside it)."""
    try:
        zf = zipfile.ZipFile(fileobj)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise InvalidUpload([f"upload: not a readable .zip archive ({exc})"]) from None
    try:
        return ZipFiles(zf)
    except DemoFileError as exc:
        raise InvalidUpload([f"upload: {exc}"]) from None
