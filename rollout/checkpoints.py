"""Where an inference worker's weights come from: a directory under its checkpoint roots, or
an artifact reference (`artifact:runs/3/v12@<sha256>`, core/artifacts.py) fetched from the
artifact store into a local cache and verified file by file before it is loaded.

With the store, nothing is read from another host's disk: the trainer uploads each version
it publishes, and each inference host fetches it by reference. The store and the cache come
from `--artifacts` / `--artifact-cache`, else DARTBOARD_ARTIFACTS / DARTBOARD_ARTIFACT_CACHE.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from core.artifacts import (
    STATE_FILE,
    ArtifactError,
    ArtifactRef,
    StoreUnreachable,
    fetch,
    is_ref,
    open_store,
)
from rollout.asgi import RequestError
from rollout.auth import checkpoint_allowed

STORE_ENV = "DARTBOARD_ARTIFACTS"
# What an inference host leaves in the store when it fetches a version: the trainer's state.
SERVING_SKIPS = frozenset({STATE_FILE})
CACHE_ENV = "DARTBOARD_ARTIFACT_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "dartboard-artifacts"


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """--artifacts and --artifact-cache (the transformers server and the vLLM adapter)."""
    parser.add_argument("--artifacts", default=None, help=f"artifact store URL (else ${STORE_ENV})")
    parser.add_argument(
        "--artifact-cache",
        default=None,
        help=f"where fetched versions are kept (else ${CACHE_ENV})",
    )


class CheckpointSource:
    """Checks a reload's `checkpoint` at once (before any work) and turns it into a local
    directory (blocking: a fetch may download gigabytes)."""

    def __init__(self, roots: list[Path], *, store: str | None = None, cache: str | None = None):
        self.roots = roots
        self.store_url = store or os.environ.get(STORE_ENV) or None
        self.cache = Path(cache or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)

    def check(self, checkpoint: str) -> None:
        if not is_ref(checkpoint):
            checkpoint_allowed(checkpoint, self.roots)
            return
        try:
            ArtifactRef.parse(checkpoint)
        except ArtifactError as exc:
            raise RequestError(str(exc), param="checkpoint") from None
        if self.store_url is None:
            raise RequestError(
                f"checkpoint {checkpoint} is an artifact reference, but this worker has no "
                f"artifact store (start it with --artifacts or ${STORE_ENV})",
                param="checkpoint",
            )

    def local(self, checkpoint: str) -> str:
        """The directory to load: the path resolved and checked against the roots again (the
        resolved path is what is loaded, so a symlink swapped after `check` leads nowhere
        else), or the verified fetched copy."""
        if not is_ref(checkpoint):
            return str(checkpoint_allowed(checkpoint, self.roots))
        assert self.store_url is not None  # check() refused a reference without a store
        ref = ArtifactRef.parse(checkpoint)
        return str(fetch(open_store(self.store_url), ref, self.cache, skip=SERVING_SKIPS))


def fetch_failure_status(exc: ArtifactError) -> int:
    """A reload whose checkpoint could not be fetched: 503 while the store does not answer
    (the router tries again later), 422 for a reference that is missing or fails its check."""
    return 503 if isinstance(exc, StoreUnreachable) else 422
