"""Checkpoints in object storage, fetched by reference and verified: no process reads another
host's disk.

A store is named by a URL (settings.DARTBOARD_ARTIFACTS, `--artifacts` on an inference
server):
- `file:///srv/dartboard/artifacts`: a directory (the single-machine default, under
  DARTBOARD_HOME; files are hard-linked into it where the filesystem allows);
- `s3://bucket/prefix`: S3 or any S3-compatible server (AWS_S3_ENDPOINT_URL,
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION from the environment).

An artifact is a directory (a checkpoint: config + safetensors, or a LoRA adapter) stored
under a key, with a manifest listing every file's size and sha256, written last so a reader
never sees a manifest whose files are still uploading. Its reference names the manifest's
own sha256: `artifact:runs/3/v12@<64 hex>`. `fetch` downloads it into a cache directory
named by that digest, checks the manifest against the reference and every file against the
manifest, and only then moves it into place: a corrupt or tampered upload is refused with
the file and both digests named, never loaded. A verified copy is reused.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urlparse

MANIFEST = "MANIFEST.json"
PREFIX = "artifact:"
# A published version's optimizer state and counters, beside its weights: what a trainer
# resumes from. Inference never reads it (for a 7B model it is several times the weights).
STATE_FILE = "trainer_state.pt"
# Matched whole (fullmatch): `$` also matches before a trailing newline.
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
_CHUNK = 1 << 20


class ArtifactError(RuntimeError):
    """An artifact that cannot be stored, found or trusted; the message says which and why."""


class StoreUnreachable(ArtifactError):
    """The store did not answer (down, restarting, timing out): trying later may work."""


@dataclass(frozen=True)
class ArtifactRef:
    key: str
    digest: str  # sha256 of the manifest's bytes

    def __str__(self) -> str:
        return f"{PREFIX}{self.key}@{self.digest}"

    @classmethod
    def parse(cls, text: str) -> ArtifactRef:
        if not text.startswith(PREFIX) or "@" not in text:
            raise ArtifactError(f"{text!r} is not an artifact reference (artifact:KEY@SHA256)")
        key, _, digest = text[len(PREFIX) :].rpartition("@")
        check_key(key)
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ArtifactError(f"{text!r}: the digest must be 64 lowercase hex characters")
        return cls(key, digest)


def is_ref(text: str) -> bool:
    return text.startswith(PREFIX)


def check_key(key: str) -> str:
    """Relative path segments of letters, digits, `._-`; no `..`, no leading `/`."""
    if not _KEY.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise ArtifactError(f"artifact key {key!r}: use segments of letters, digits and ._- ")
    return key


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_of(directory: Path) -> bytes:
    """The manifest of every regular file under `directory` (sorted, so it is canonical)."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        if path.is_symlink():
            raise ArtifactError(f"{path}: symlinks are not stored (copy the file)")
        rel = path.relative_to(directory).as_posix()
        if rel == MANIFEST:
            continue
        files[rel] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    if not files:
        raise ArtifactError(f"{directory} holds no files to store")
    return json.dumps({"files": files}, sort_keys=True, indent=1).encode()


class Store(Protocol):
    """Where artifacts live. Keys are `/`-separated; each backend maps them to its names."""

    url: str

    def put(self, name: str, source: Path) -> None: ...

    def put_bytes(self, name: str, data: bytes) -> None: ...

    def get(self, name: str, target: IO[bytes]) -> None: ...

    def get_bytes(self, name: str) -> bytes: ...

    def delete(self, name: str) -> None: ...


class FileStore:
    """A directory. Files are hard-linked in when the store is on the same filesystem (a
    7B checkpoint then costs no second copy), copied otherwise."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    def _path(self, name: str) -> Path:
        return self.root / name

    def put(self, name: str, source: Path) -> None:
        target = self._path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)

    def put_bytes(self, name: str, data: bytes) -> None:
        target = self._path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def get(self, name: str, target: IO[bytes]) -> None:
        try:
            with self._path(name).open("rb") as f:
                shutil.copyfileobj(f, target, _CHUNK)
        except FileNotFoundError:
            raise ArtifactError(f"{self.url}: no object {name}") from None

    def link(self, name: str, target: Path) -> bool:
        """Hard-link the object to `target` (same filesystem); False where it cannot."""
        try:
            os.link(self._path(name), target)
            return True
        except FileNotFoundError:
            raise ArtifactError(f"{self.url}: no object {name}") from None
        except OSError:
            return False

    def get_bytes(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            raise ArtifactError(f"{self.url}: no object {name}") from None

    def delete(self, name: str) -> None:
        """Remove the object; one already gone is not an error."""
        self._path(name).unlink(missing_ok=True)


def s3_client_config() -> Any:
    """Every S3 client's limits (botocore Config): a store that stops answering fails a call
    in seconds, not after botocore's default 60 s read timeout times five tries, so the
    caller's outage retry (workers/dbutil.py) decides how long to wait and says so. The read
    timeout is per socket read, so large uploads are not cut short."""
    from botocore.config import Config  # start-up cost only where S3 is used

    return Config(
        connect_timeout=5, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"}
    )


def s3_transfer_config() -> Any:
    """Screenshot uploads through django-storages: one small object at a time, so no transfer
    thread pool (its threads outlive the call and hold a worker's exit)."""
    from boto3.s3.transfer import TransferConfig  # start-up cost only where S3 is used

    return TransferConfig(use_threads=False)


class S3Store:
    """A bucket and prefix on S3 or an S3-compatible server (boto3; credentials and the
    endpoint from the environment). The client is made on first use: a fetch that finds its
    copy in the cache (a policy's geometry read per batch, say) never pays for one."""

    def __init__(self, bucket: str, prefix: str, *, client: Any | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        if client is not None:
            self.client = client

    @functools.cached_property
    def client(self) -> Any:
        import boto3  # start-up cost only where an S3 store is used

        return boto3.client(
            "s3",
            endpoint_url=os.environ.get("AWS_S3_ENDPOINT_URL") or None,
            config=s3_client_config(),
        )

    def _name(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def put(self, name: str, source: Path) -> None:
        self.client.upload_file(str(source), self.bucket, self._name(name))

    def put_bytes(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._name(name), Body=data)

    def get(self, name: str, target: IO[bytes]) -> None:
        with self._reading(name):
            self.client.download_fileobj(self.bucket, self._name(name), target)

    def delete(self, name: str) -> None:
        """Remove the object; one already gone is not an error (S3's own rule)."""
        self.client.delete_object(Bucket=self.bucket, Key=self._name(name))

    def get_bytes(self, name: str) -> bytes:
        with self._reading(name):
            body = self.client.get_object(Bucket=self.bucket, Key=self._name(name))["Body"]
            return bytes(body.read())

    @contextlib.contextmanager
    def _reading(self, name: str) -> Iterator[None]:
        """A failed read as ArtifactError (StoreUnreachable when the server did not answer)."""
        from botocore.exceptions import ClientError, HTTPClientError
        from botocore.exceptions import ConnectionError as BotoConnectionError

        try:
            yield
        except (BotoConnectionError, HTTPClientError) as exc:
            raise StoreUnreachable(f"{self.url}: unreachable while reading {name}: {exc}") from None
        except ClientError as exc:
            raise ArtifactError(f"{self.url}: cannot read {name}: {exc}") from None


def open_store(url: str) -> FileStore | S3Store:
    parsed = urlparse(url)
    if parsed.scheme == "file" and parsed.path:
        return FileStore(Path(parsed.path))
    if parsed.scheme == "s3" and parsed.netloc:
        return S3Store(parsed.netloc, parsed.path)
    raise ArtifactError(f"artifact store {url!r}: use file:///absolute/path or s3://bucket/prefix")


def upload_dir(store: Store, key: str, directory: Path) -> ArtifactRef:
    """Store every file of `directory` under `key`, then its manifest; returns the reference."""
    check_key(key)
    manifest = manifest_of(directory)
    for rel in json.loads(manifest)["files"]:
        store.put(f"{key}/{rel}", directory / rel)
    store.put_bytes(f"{key}/{MANIFEST}", manifest)
    return ArtifactRef(key, hashlib.sha256(manifest).hexdigest())


def cached_copy(
    cache: Path,
    ref: ArtifactRef,
    *,
    skip: frozenset[str] = frozenset(),
    only: frozenset[str] | None = None,
) -> Path:
    """Where `fetch` keeps the artifact's copy (without the files in `skip`, or of the files
    in `only`): a partial copy lives apart from the whole one."""
    name = ref.digest
    if skip:
        name += f"-without-{'-'.join(sorted(skip))}"
    if only is not None:
        name += f"-only-{'-'.join(sorted(only))}"
    return cache / name


def fetch(
    store: Store,
    ref: ArtifactRef,
    cache: Path,
    *,
    skip: frozenset[str] = frozenset(),
    only: frozenset[str] | None = None,
) -> Path:
    """The artifact's verified local copy under `cache` (downloaded once; reused after).
    Files named in `skip` are left in the store (an inference host needs no optimizer
    state); with `only`, just those files are fetched (an env worker needs a policy's
    processor config, not its weights)."""
    target = cached_copy(cache, ref, skip=skip, only=only)
    if (target / MANIFEST).is_file():
        os.utime(target)  # used now: pruning keeps the most recently used copies
        return target
    manifest = store.get_bytes(f"{ref.key}/{MANIFEST}")
    got = hashlib.sha256(manifest).hexdigest()
    if got != ref.digest:
        raise ArtifactError(
            f"artifact {ref.key}: its manifest has sha256 {got}, the reference names "
            f"{ref.digest} (replaced or corrupt in {store.url}); not loaded"
        )
    files = json.loads(manifest)["files"]
    cache.mkdir(parents=True, exist_ok=True)
    with _staging(cache) as staging:
        for rel, entry in files.items():
            check_key(rel)
            if rel in skip or (only is not None and rel not in only):
                continue
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            # A file store on this filesystem costs no copy; it is verified all the same.
            if not (isinstance(store, FileStore) and store.link(f"{ref.key}/{rel}", path)):
                with path.open("wb") as f:
                    store.get(f"{ref.key}/{rel}", f)
            size, digest = path.stat().st_size, sha256_file(path)
            if size != entry["size"] or digest != entry["sha256"]:
                raise ArtifactError(
                    f"artifact {ref.key}: file {rel} has sha256 {digest} ({size} bytes), its "
                    f"manifest says {entry['sha256']} ({entry['size']} bytes): corrupt or "
                    f"tampered in {store.url}; not loaded"
                )
        (staging / MANIFEST).write_bytes(manifest)  # last: marks the copy complete
        with contextlib.suppress(OSError):  # a concurrent fetch finished first: keep it
            os.replace(staging, target)
    prune_cache(cache, keep=CACHE_KEEP, current=target)
    return target


CACHE_KEEP = 4  # verified copies a host keeps (the newest by use); older ones are deleted


def prune_cache(cache: Path, *, keep: int, current: Path) -> list[Path]:
    """Delete all but the `keep` most recently fetched copies (never `current`): a long run
    publishes a version a minute, and a host needs only the one it serves."""
    copies = sorted(
        (p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    removed = [p for p in copies[keep:] if p != current]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


@contextlib.contextmanager
def _staging(cache: Path) -> Iterator[Path]:
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
