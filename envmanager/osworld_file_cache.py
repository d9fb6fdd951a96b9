"""OSWorld's task files from a content-addressed cache on this host, never from the internet
at run time.

Most OSWorld tasks fetch files by URL: a `download` setup step puts a file on the VM, and a
`cloud_file` getter fetches the expected file the metric compares with. OSWorld's own
client downloads both from its file cache on the internet as the task runs. Here every
such URL must already be in the cache (`FileCache`, under `DARTBOARD_HOME/osworld-files`):

    objects/<sha256[:2]>/<sha256>      the file's bytes, named by their hash
    urls/<sha256 of the url>.json      {"url", "sha256", "size"}

`osworld_cache fetch` fills it where the internet is reachable, `osworld_cache add DIR`
from a copy of OSWorld's file-cache folder (`<domain>/<task id>/<file name>`); at reset the
env puts each file at the very path OSWorld's client looks in first (`place_task_files`),
so the wheel's `_download_setup` and `get_cloud_file` find it there and download nothing. A
task with a URL the cache lacks is refused before its setup runs, naming the URLs; an object
whose bytes no longer match its hash is refused and never served.

    cache = FileCache(Path("var/osworld-files"))
    cache.fetch("https://.../resolve/main/vlc/<id>/video.mp4")
    missing = cache.missing(task_urls(spec))
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

MAX_FILE_BYTES = 2 * 1024**3  # OSWorld's largest task files are videos of a few hundred MiB
FETCH_TIMEOUT_S = 60.0
# OSWorld's file cache on Hugging Face: a URL below this prefix names its file by
# <domain>/<task id>/<file name>, the layout of a downloaded copy of that dataset.
OSWORLD_CACHE_MARKER = "/ubuntu_osworld_file_cache/resolve/main/"


class CacheError(Exception):
    """A file could not be cached or served; str() says which and why."""


@dataclass(frozen=True)
class TaskFile:
    """One file an OSWorld task fetches by URL: where the task names it and the file name
    the wheel gives it (a download step's target path, a cloud_file getter's `dest`)."""

    url: str
    where: str  # "config[0].parameters.files[1]" or "evaluator.expected"
    kind: str  # "download" | "cloud_file"
    name: str  # download: the VM path; cloud_file: the cache file name (dest)


def _download_files(steps: Any, field: str) -> Iterator[TaskFile]:
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        if not isinstance(step, dict) or step.get("type") != "download":
            continue
        files = (step.get("parameters") or {}).get("files")
        for j, item in enumerate(files if isinstance(files, list) else []):
            if isinstance(item, dict) and isinstance(item.get("url"), str):
                where = f"{field}[{i}].parameters.files[{j}]"
                yield TaskFile(item["url"], where, "download", str(item.get("path", "")))


def _cloud_files(getter: Any, where: str) -> Iterator[TaskFile]:
    if not isinstance(getter, dict) or getter.get("type") != "cloud_file":
        return
    paths, dests = getter.get("path"), getter.get("dest")
    if not getter.get("multi", False):
        paths, dests = [paths], [dests]
    for url, dest in zip(paths or [], dests or [], strict=False):
        if isinstance(url, str):
            yield TaskFile(url, where, "cloud_file", str(dest))


def task_files_by_url(spec: dict[str, Any]) -> list[TaskFile]:
    """Every file an OSWorld task object fetches by URL, in the order it names them."""
    evaluator: dict[str, Any] = spec["evaluator"] if isinstance(spec.get("evaluator"), dict) else {}
    found = [
        *_download_files(spec.get("config"), "config"),
        *_download_files(evaluator.get("postconfig"), "evaluator.postconfig"),
    ]
    for key in ("result", "expected"):
        value = evaluator.get(key)
        for i, getter in enumerate(value if isinstance(value, list) else [value]):
            found += _cloud_files(
                getter, f"evaluator.{key}" + (f"[{i}]" if isinstance(value, list) else "")
            )
    return found


def task_urls(spec: dict[str, Any]) -> list[str]:
    """The distinct URLs an OSWorld task object fetches."""
    return list(dict.fromkeys(f.url for f in task_files_by_url(spec)))


def layout_path(url: str, task_id: str, name: str) -> PurePosixPath:
    """Where OSWorld's file-cache folder keeps `url`'s file: the path after the dataset's
    `resolve/main/` for its own URLs, else `<task id>/<the file's name in the task>`."""
    path = unquote(urlparse(url).path)
    if OSWORLD_CACHE_MARKER in path:
        return PurePosixPath(path.split(OSWORLD_CACHE_MARKER, 1)[1])
    return PurePosixPath(task_id) / PurePosixPath(name).name


@dataclass(frozen=True)
class Entry:
    url: str
    sha256: str
    size: int


class FileCache:
    """The content-addressed cache of one host (see the module docstring). Safe for several
    processes: every write goes to a temporary file renamed into place."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _index(self, url: str) -> Path:
        return self.root / "urls" / f"{hashlib.sha256(url.encode()).hexdigest()}.json"

    def _object(self, sha256: str) -> Path:
        return self.root / "objects" / sha256[:2] / sha256

    def lookup(self, url: str) -> Entry | None:
        try:
            data = json.loads(self._index(url).read_text())
        except (FileNotFoundError, ValueError):
            return None
        if data.get("url") != url or not self._object(data["sha256"]).is_file():
            return None
        return Entry(url, data["sha256"], int(data["size"]))

    def missing(self, urls: list[str]) -> list[str]:
        """The URLs among `urls` the cache has no file for."""
        return [url for url in urls if self.lookup(url) is None]

    def entries(self) -> list[Entry]:
        found = []
        for index in sorted((self.root / "urls").glob("*.json")):
            data = json.loads(index.read_text())
            if (entry := self.lookup(data.get("url", ""))) is not None:
                found.append(entry)
        return found

    def add_file(self, url: str, path: Path) -> Entry:
        """Cache the file at `path` as `url`'s (copied, hashed as it is copied)."""
        with open(path, "rb") as source:
            return self._store(url, iter(lambda: source.read(1 << 20), b""))

    def fetch(self, url: str, *, timeout: float = FETCH_TIMEOUT_S) -> Entry:
        """Download `url` into the cache (the one place Dartboard opens a task's URL)."""
        if urlparse(url).scheme not in ("http", "https"):
            raise CacheError(f"{url}: only http and https URLs can be fetched")
        # Imported here for start-up cost: every worker imports this module (a run's check at
        # create reads the cache), only the fetch command downloads.
        import requests

        try:
            with requests.get(url, stream=True, timeout=timeout) as answer:
                answer.raise_for_status()
                return self._store(url, answer.iter_content(1 << 20))
        except requests.RequestException as exc:
            raise CacheError(f"{url}: {exc}") from exc

    def _store(self, url: str, chunks: Any) -> Entry:
        digest, size = hashlib.sha256(), 0
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root / "objects", prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    size += len(chunk)
                    if size > MAX_FILE_BYTES:
                        raise CacheError(f"{url}: larger than {MAX_FILE_BYTES // 2**20} MiB")
                    digest.update(chunk)
                    out.write(chunk)
            sha = digest.hexdigest()
            self._object(sha).parent.mkdir(exist_ok=True)
            os.replace(tmp, self._object(sha))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        index = self._index(url)
        index.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=index.parent, prefix=".incoming-")
        with os.fdopen(fd, "w") as out:
            json.dump({"url": url, "sha256": sha, "size": size}, out)
        os.replace(tmp, index)
        return Entry(url, sha, size)

    def copy_to(self, url: str, target: Path) -> None:
        """Write `url`'s cached file at `target` (0600), its bytes checked against their
        hash as they are copied: a mismatch removes the copy and raises CacheError."""
        entry = self.lookup(url)
        if entry is None:
            raise CacheError(f"{url} is not in the file cache ({self.root})")
        digest = hashlib.sha256()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(self._object(entry.sha256), "rb") as source, os.fdopen(fd, "wb") as out:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry.sha256:
            target.unlink(missing_ok=True)
            raise CacheError(
                f"{url}: the cached file {self._object(entry.sha256)} does not match its "
                "hash (changed on disk): refused; fetch it again"
            )


def wheel_cache_name(task_file: TaskFile) -> str:
    """The file name OSWorld's client looks for in its cache directory before it downloads:
    `_download_setup`'s `<uuid5(url)>_<basename of the VM path>`, `get_cloud_file`'s dest."""
    if task_file.kind == "download":
        return f"{uuid.uuid5(uuid.NAMESPACE_URL, task_file.url)}_{os.path.basename(task_file.name)}"
    return task_file.name


def place_task_files(spec: dict[str, Any], cache: FileCache, into: Path) -> None:
    """Put every file the task fetches by URL into the wheel's cache directory `into`, where
    its client finds it and downloads nothing. CacheError names the URLs the cache lacks."""
    files = task_files_by_url(spec)
    missing = cache.missing(task_urls(spec))
    if missing:
        raise CacheError(
            f"{len(missing)} file(s) of this task are not in the file cache ({cache.root}): "
            + ", ".join(missing)
            + " (`manage.py osworld_cache fetch` or `osworld_cache add DIR` puts them there)"
        )
    for task_file in files:
        name = wheel_cache_name(task_file)
        if not name or "/" in name or name in (".", ".."):
            raise CacheError(f"{task_file.where}: {name!r} is not a file name")
        cache.copy_to(task_file.url, into / name)


def copy_layout(
    cache: FileCache, source: Path, spec: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """Cache the files of one task found in a copy of OSWorld's file-cache folder `source`.
    Returns (added URLs, URLs whose file the folder lacks)."""
    added, lacking = [], []
    for task_file in task_files_by_url(spec):
        relative = layout_path(task_file.url, str(spec.get("id", "")), task_file.name)
        candidates = [source / relative, *source.glob(f"*/{relative}")]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None or not found.resolve().is_relative_to(source.resolve()):
            lacking.append(task_file.url)
            continue
        cache.add_file(task_file.url, found)
        added.append(task_file.url)
    return list(dict.fromkeys(added)), list(dict.fromkeys(lacking))


def clear_directory(path: Path) -> None:
    """Empty `path` (the env's cache directory between tasks), keeping the directory."""
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
