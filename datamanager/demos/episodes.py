"""What every demonstration format reads into, and the checks every file passes.

A reader (`osworld.py`, `agentnet.py`, `archive.py`'s) turns its files into `DemoEpisode`s
without holding their pixels: each step names its screenshot in the source and carries the
size and SHA-256 its check found. The import (`datamanager.services.demos`) validates every
episode first, then reads each screenshot once more while it writes, so thousands of
episodes never sit in memory at once.

Sources are a folder on disk (`DirFiles`, the command line) or an uploaded .zip
(`ZipFiles`, the upload page). Both refuse a name that leaves the source (`..`, an absolute
path, a link out of the folder) and read within budgets: per file, and in all.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Protocol

from PIL import Image

from core.protocol import Action

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one screenshot file
MAX_MANIFEST_BYTES = 8 * 1024 * 1024  # Dartboard's manifest.json
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_TEXT_BYTES = 64 * 1024 * 1024  # one traj.jsonl
MAX_LINE_BYTES = 16 * 1024 * 1024  # one line of an AgentNet .jsonl (read line by line)
MAX_TOTAL_BYTES = 512 * 1024 * 1024  # every file of one upload, uncompressed
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    RuntimeError,
    NotImplementedError,
    EOFError,
    OSError,
    zlib.error,
)


class DemoFileError(ValueError):
    """A file of a demonstration source cannot be used; the message says why (not where:
    the caller prefixes the file)."""


class DemoFiles(Protocol):
    """Files of a source, by their POSIX path relative to its top."""

    label: str  # how messages name the source: the folder or the upload

    def names(self) -> list[str]: ...

    def read(self, name: str, *, limit: int) -> bytes: ...

    def lines(self, name: str) -> Iterator[tuple[int, bytes]]:
        """(line number, line) of a text file too large to read at once."""
        ...


def _lines(fh: IO[bytes], name: str) -> Iterator[tuple[int, bytes]]:
    for n, line in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 1), b""), start=1):
        if len(line) > MAX_LINE_BYTES:
            raise DemoFileError(f"line {n} of {name} is longer than {MAX_LINE_BYTES // 2**20} MiB")
        yield n, line


def _safe_name(name: str) -> str:
    """`name` if it stays inside its source, else DemoFileError."""
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name or not name:
        raise DemoFileError(f"{name!r} leaves the source (absolute, '..' or '\\' in its path)")
    return str(path)


class DirFiles:
    """A folder on disk. Links pointing out of it are refused when read."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.label = str(root)

    def names(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.root).as_posix()) for p in self.root.rglob("*") if p.is_file()
        )

    def read(self, name: str, *, limit: int) -> bytes:
        path = (self.root / _safe_name(name)).resolve()
        if not path.is_relative_to(self.root):
            raise DemoFileError(f"{name!r} links out of {self.label}")
        try:
            with path.open("rb") as fh:
                data = fh.read(limit + 1)
        except OSError as exc:
            raise DemoFileError(f"cannot be read ({exc.strerror or exc})") from None
        if len(data) > limit:
            raise DemoFileError(f"larger than {limit // 2**20} MiB")
        return data

    def lines(self, name: str) -> Iterator[tuple[int, bytes]]:
        path = (self.root / _safe_name(name)).resolve()
        if not path.is_relative_to(self.root):
            raise DemoFileError(f"{name!r} links out of {self.label}")
        with path.open("rb") as fh:
            yield from _lines(fh, name)


class ZipFiles:
    """An uploaded .zip, read in memory within `MAX_TOTAL_BYTES` (never extracted). A member
    whose name leaves the archive makes the whole upload invalid."""

    def __init__(self, zf: zipfile.ZipFile, *, label: str = "upload") -> None:
        self.zf = zf
        self.label = label
        self.total = 0
        infos = [i for i in zf.infolist() if not i.is_dir()]
        unsafe = []
        for info in infos:
            try:
                _safe_name(info.filename)
            except DemoFileError as exc:
                unsafe.append(str(exc))
        if unsafe:
            raise DemoFileError(f"unsafe member name(s) in the zip: {'; '.join(unsafe[:5])}")
        self.infos = {i.filename: i for i in infos}

    def names(self) -> list[str]:
        return sorted(self.infos)

    def read(self, name: str, *, limit: int) -> bytes:
        info = self.infos.get(name)
        if info is None:
            raise DemoFileError("is not in the archive")
        if info.file_size > limit:
            raise DemoFileError(f"larger than {limit // 2**20} MiB")
        if self.total + info.file_size > MAX_TOTAL_BYTES:
            raise DemoFileError(f"the archive holds more than {MAX_TOTAL_BYTES // 2**20} MiB")
        try:
            with self.zf.open(info) as member:
                data = member.read(limit + 1)  # the header's size may lie: read at most this
        except ZIP_ERRORS as exc:
            raise DemoFileError(
                f"cannot be read from the zip ({type(exc).__name__}: {exc})"
            ) from None
        if len(data) > limit:
            raise DemoFileError(f"larger than {limit // 2**20} MiB")
        self.total += len(data)
        return data

    def lines(self, name: str) -> Iterator[tuple[int, bytes]]:
        # Within the upload's budget: the zip is in memory and bounded already.
        data = self.read(name, limit=MAX_TOTAL_BYTES)
        yield from _lines(io.BytesIO(data), name)


def screen_size(text: str) -> tuple[int, int] | None:
    """'1920x1080' -> (1920, 1080); '' -> None; ValueError saying what is expected."""
    if not text.strip():
        return None
    width, sep, height = text.strip().lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or not int(width) or not int(height):
        raise ValueError(f"{text!r} is not a screen size: write it as WIDTHxHEIGHT, e.g. 1920x1080")
    return int(width), int(height)


@dataclass(frozen=True)
class Shot:
    """A checked screenshot: where it is in the source, its size and its bytes' SHA-256."""

    name: str
    width: int
    height: int
    sha256: str


def image_check(data: bytes) -> tuple[int, int]:
    """(width, height) of a usable screenshot, or DemoFileError: its format, its pixel count
    read from the header before decoding (a decompression bomb is refused unread), then a
    full decode."""
    try:
        with warnings.catch_warnings():  # the pixel count is checked below, before decoding
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        with img:
            if img.format not in IMAGE_FORMATS:
                raise DemoFileError(f"is {img.format}, not one of {', '.join(IMAGE_FORMATS)}")
            width, height = img.size
            if width * height > MAX_IMAGE_PIXELS:
                raise DemoFileError(f"{width}x{height} is more than {MAX_IMAGE_PIXELS} pixels")
            img.load()
    except DemoFileError:
        raise
    except Exception as exc:  # PIL raises many kinds for a broken file
        raise DemoFileError(f"is not a readable image ({exc})") from None
    return width, height


def shot_read(files: DemoFiles, name: str) -> Shot:
    """Check the screenshot `name` of `files`; DemoFileError says what is wrong with it."""
    data = files.read(name, limit=MAX_IMAGE_BYTES)
    width, height = image_check(data)
    return Shot(name=name, width=width, height=height, sha256=hashlib.sha256(data).hexdigest())


def shot_png(files: DemoFiles, shot: Shot) -> bytes:
    """The screenshot as PNG bytes (Dartboard's screenshots are PNG), read again and checked
    to be the file the validation saw."""
    data = files.read(shot.name, limit=MAX_IMAGE_BYTES)
    if hashlib.sha256(data).hexdigest() != shot.sha256:
        raise DemoFileError(f"{shot.name} changed while it was being imported")
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return data
    with Image.open(io.BytesIO(data)) as img:
        out = io.BytesIO()
        img.convert("RGB").save(out, format="PNG")
    return out.getvalue()


@dataclass(frozen=True)
class DemoStep:
    """One action and the screen the agent saw when it chose it (screen pixels)."""

    shot: Shot
    action: Action
    thought: str
    source: str  # where it is recorded: "file:line", for messages
    recorded: str  # the recorded action text (pyautogui code, or Dartboard's reply)


@dataclass(frozen=True)
class DemoEpisode:
    """One demonstration as its format records it, checked."""

    task_key: str  # a Dartboard task name, or the format's task id
    instruction: str
    reward: float
    steps: list[DemoStep]
    source: str  # its folder or file:line
    notes: list[str] = field(default_factory=list)  # what the import did that a user should know

    def content_hash(self, task_name: str) -> str:
        """SHA-256 over the task it was matched to, the actions, the texts and the screenshots'
        bytes: the same episode imported twice has the same hash, whatever its file names."""
        h = hashlib.sha256(task_name.encode())
        for step in self.steps:
            part = [step.action.to_json(), step.thought, step.shot.sha256]
            h.update(json.dumps(part, sort_keys=True).encode())
        return h.hexdigest()
