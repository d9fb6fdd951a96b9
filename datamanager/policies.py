"""Resolving a run's policy name to its checkpoint directory and its image geometry.

A policy is a name (`shipped`, `shipped-desktop`, `untrained`, `oracle`), a local checkpoint
directory, or an artifact reference (`artifact:policies/...@sha256`, made by `manage.py
publish_policy DIR`): a base model an admin brought, stored once in the artifact store, that
every host (trainer, inference, env workers reading its image geometry and tokenizer) fetches and verifies
into its own cache.
On more than one host, give a run a reference, not a path: no host reads another's disk.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from django.conf import settings

from core.artifacts import (
    ArtifactError,
    ArtifactRef,
    fetch,
    is_ref,
    manifest_of,
    open_store,
    upload_dir,
)
from core.imaging import GEOMETRY_FILE, QWEN25_VL, ImageGeometry
from core.prompt_counter import COUNTER_FILES, PromptCounter
from datamanager.models import PolicyVersion

ORACLE_POLICY = "oracle"  # a run config policy name: the scripted oracle, no model
NAMED_POLICIES = ("shipped", "shipped-desktop", "untrained", ORACLE_POLICY)  # else a path

SHIPPED_POLICY = Path(settings.BASE_DIR) / "policies" / "tiny-grounded"
# The same tiny policy, further pretrained on synthetic 800x600 desktops (`make
# policy-desktop`): `make run-desktop` starts from it.
SHIPPED_DESKTOP_POLICY = Path(settings.BASE_DIR) / "policies" / "tiny-desktop"


class EvalSetupError(Exception):
    """The evaluation could not run (bad policy, no tasks, server failed to start)."""


class PolicyNotFound(Exception):
    pass


def policy_path(name: str) -> Path:
    """'shipped' (the repository's pretrained tiny policy), 'shipped-desktop' (its desktop
    pretraining), 'untrained' (built by `manage.py make_tiny_policy`), an artifact reference (fetched and verified into this
    host's cache) or a local Hugging Face checkpoint directory."""
    if is_ref(name):
        return _fetch_policy(name)
    if name == "shipped":
        path = SHIPPED_POLICY
        if not (path / "config.json").exists():
            # Until a grounded policy ships, fall back to the locally built untrained one.
            path = settings.DARTBOARD_HOME / "policies" / "untrained"
    elif name == "shipped-desktop":
        path = SHIPPED_DESKTOP_POLICY
    elif name == "untrained":
        path = settings.DARTBOARD_HOME / "policies" / "untrained"
    else:
        path = Path(name).expanduser()
    if not (path / "config.json").exists():
        raise PolicyNotFound(
            f"policy {name!r}: no Hugging Face checkpoint at {path} (run "
            "`python manage.py make_tiny_policy` for the untrained tiny policy)"
        )
    return path


@functools.lru_cache(maxsize=64)
def _geometry_of(path: str) -> ImageGeometry:
    return ImageGeometry.from_policy_dir(path)


def policy_geometry(name: str) -> ImageGeometry:
    """The image geometry of the policy's processor: every coordinate and image-token count
    of a run comes from here. The scripted oracle writes and reads Qwen2.5-VL's."""
    if name == ORACLE_POLICY:
        return QWEN25_VL
    if is_ref(name):  # the processor's config, not the weights (an env worker needs no more)
        return _geometry_of(str(_fetch_policy(name, only=frozenset({GEOMETRY_FILE}))))
    return _geometry_of(str(policy_path(name)))


@functools.lru_cache(maxsize=64)
def _counter_of(path: str) -> PromptCounter:
    return PromptCounter.from_policy_dir(path)


def checkpoint_prompt_counter(path: Path) -> PromptCounter:
    """The prompt counter of a checkpoint directory on this host (a full one or an adapter:
    both carry the tokenizer and processor configs), read once per process."""
    return _counter_of(str(path))


def policy_prompt_counter(name: str) -> PromptCounter:
    """How the policy's processor counts a prompt (its tokenizer, chat template and image
    geometry): a run's prompt budgets are met with it. The scripted oracle, which no server
    counts, gets the byte bound over its geometry."""
    if name == ORACLE_POLICY:
        return PromptCounter.bound(policy_geometry(name))
    if is_ref(name):  # the tokenizer and processor configs, not the weights
        return _counter_of(str(_fetch_policy(name, only=COUNTER_FILES)))
    return _counter_of(str(policy_path(name)))


def resolve_checkpoint(policy: str) -> tuple[Path | None, int | None]:
    """(checkpoint dir, version) for 'oracle' (None), 'run:ID:vN' or a local directory."""
    if policy == ORACLE_POLICY:
        return None, None
    if policy.startswith("run:"):
        try:
            _, run_id, v = policy.split(":")
            pv = PolicyVersion.objects.get(run_id=int(run_id), version=int(v.lstrip("v")))
        except (ValueError, PolicyVersion.DoesNotExist):
            raise EvalSetupError(
                f"policy {policy!r}: no such run policy version (use run:ID:vN)"
            ) from None
        if pv.pruned_at is not None:
            raise EvalSetupError(
                f"policy {policy!r}: its weights were deleted on {pv.pruned_at:%Y-%m-%d %H:%M} "
                "UTC (the run keeps trainer.versions_kept versions, every "
                "trainer.versions_keep_every-th and the best); evaluate a version it kept"
            )
        return Path(pv.checkpoint), pv.version
    try:
        return policy_path(policy), None
    except PolicyNotFound as exc:
        raise EvalSetupError(str(exc)) from None


def _fetch_policy(name: str, *, only: frozenset[str] | None = None) -> Path:
    try:
        store = open_store(settings.DARTBOARD_ARTIFACTS)
        return fetch(store, ArtifactRef.parse(name), settings.DARTBOARD_ARTIFACT_CACHE, only=only)
    except ArtifactError as exc:
        raise PolicyNotFound(f"policy {name!r}: {exc}") from None


def policy_publish(directory: Path) -> str:
    """Store a checkpoint directory under `policies/` in the artifact store; its reference,
    which names it by content (publishing the same directory twice gives the same one)."""
    if (
        not (directory / "config.json").exists()
        and not (directory / "adapter_config.json").exists()
    ):
        raise PolicyNotFound(f"{directory}: not a Hugging Face checkpoint (no config.json)")
    digest = hashlib.sha256(manifest_of(directory)).hexdigest()
    store = open_store(settings.DARTBOARD_ARTIFACTS)
    return str(upload_dir(store, f"policies/{directory.name}-{digest[:16]}", directory))
