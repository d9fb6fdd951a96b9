"""Checkpoints through object storage (core/artifacts.py): stored with a manifest, fetched
by reference on another "host" (another directory), verified file by file. Against a real
S3 API: moto's server on 127.0.0.1, started and stopped by the test."""

from __future__ import annotations

import filecmp
import os
import shutil

import pytest

from core.artifacts import (
    STATE_FILE,
    ArtifactError,
    ArtifactRef,
    FileStore,
    S3Store,
    fetch,
    open_store,
    upload_dir,
)
from rollout.checkpoints import SERVING_SKIPS


@pytest.fixture
def bucket(s3_artifacts):
    return open_store(s3_artifacts)


def _same_tree(a, b) -> bool:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    return names == sorted(
        p.relative_to(b).as_posix()
        for p in b.rglob("*")
        if p.is_file() and p.name != "MANIFEST.json"
    ) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def test_a_checkpoint_stored_in_s3_is_fetched_whole_on_another_host(
    bucket, tiny_policy_dir, tmp_path
):
    ref = upload_dir(bucket, "runs/1/v3", tiny_policy_dir)
    assert isinstance(bucket, S3Store) and str(ref).startswith("artifact:runs/1/v3@")
    assert ArtifactRef.parse(str(ref)) == ref

    local = fetch(bucket, ref, tmp_path / "host-b-cache")
    assert local == tmp_path / "host-b-cache" / ref.digest
    assert _same_tree(tiny_policy_dir, local)


def test_a_corrupt_upload_is_refused_naming_the_file_and_nothing_is_cached(
    bucket, s3_server, tiny_policy_dir, tmp_path
):
    ref = upload_dir(bucket, "runs/2/v1", tiny_policy_dir)
    weights = next(p.name for p in tiny_policy_dir.iterdir() if p.suffix == ".safetensors")
    data = bytearray((tiny_policy_dir / weights).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the weights
    s3_server.client().put_object(
        Bucket="dartboard", Key=f"artifacts/runs/2/v1/{weights}", Body=bytes(data)
    )

    cache = tmp_path / "cache"
    with pytest.raises(ArtifactError) as failure:
        fetch(bucket, ref, cache)
    message = str(failure.value)
    assert f"file {weights}" in message and "corrupt or tampered" in message
    assert not (cache / ref.digest).exists() and os.listdir(cache) == []


def test_a_replaced_manifest_does_not_match_its_reference(
    bucket, s3_server, tiny_policy_dir, tmp_path
):
    ref = upload_dir(bucket, "runs/3/v1", tiny_policy_dir)
    upload_dir(bucket, "runs/3/v1", _other_dir(tmp_path))  # overwritten under the same key
    with pytest.raises(ArtifactError, match=r"its manifest has sha256 .* the reference names"):
        fetch(bucket, ref, tmp_path / "cache")


def _other_dir(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    return other


def test_the_file_store_links_instead_of_copying_and_refuses_bad_keys(tiny_policy_dir, tmp_path):
    store = FileStore(tmp_path / "store")
    ref = upload_dir(store, "runs/1/v1", tiny_policy_dir)
    config = tmp_path / "store" / "runs" / "1" / "v1" / "config.json"
    assert config.stat().st_ino == (tiny_policy_dir / "config.json").stat().st_ino
    local = fetch(store, ref, tmp_path / "cache")
    assert _same_tree(tiny_policy_dir, local)
    # Fetched once: the verified copy is reused, even with the store gone.
    shutil.rmtree(tmp_path / "store")
    assert fetch(store, ref, tmp_path / "cache") == local
    for key in ("../escape", "/abs", "runs/../../x", ""):
        with pytest.raises(ArtifactError, match="artifact key"):
            upload_dir(store, key, tiny_policy_dir)
    with pytest.raises(ArtifactError, match="use file:///absolute/path or s3://bucket/prefix"):
        open_store("ftp://host/x")


def test_a_host_keeps_only_its_newest_fetched_versions(tiny_policy_dir, tmp_path, monkeypatch):
    """A version a minute for hours would fill the disk: the cache keeps the newest few."""
    import time

    monkeypatch.setattr("core.artifacts.CACHE_KEEP", 2)
    store = FileStore(tmp_path / "store")
    refs = []
    for version in range(4):
        directory = tmp_path / f"v{version}"
        shutil.copytree(tiny_policy_dir, directory)
        (directory / "VERSION").write_text(str(version))
        refs.append(upload_dir(store, f"runs/1/v{version}", directory))
    cache = tmp_path / "cache"
    for ref in refs:
        fetch(store, ref, cache)
        time.sleep(0.01)  # distinct modification times
    assert sorted(p.name for p in cache.iterdir()) == sorted(r.digest for r in refs[2:])
    # On one filesystem the cached copy is a link to the stored file, not a second copy.
    stored = tmp_path / "store" / "runs" / "1" / "v3" / "config.json"
    assert (cache / refs[3].digest / "config.json").stat().st_ino == stored.stat().st_ino


def test_an_inference_host_fetches_the_weights_without_the_trainer_state(
    bucket, tiny_policy_dir, tmp_path
):
    version = tmp_path / "v4"
    shutil.copytree(tiny_policy_dir, version)
    (version / STATE_FILE).write_bytes(os.urandom(4096))  # optimizer state, for a resume
    ref = upload_dir(bucket, "runs/1/v4", version)

    served = fetch(bucket, ref, tmp_path / "host-c-cache", skip=SERVING_SKIPS)
    assert not (served / STATE_FILE).exists()
    assert (served / "config.json").is_file() and (served / "model.safetensors").is_file()
    # The trainer on a new host still gets the whole version, in a copy of its own.
    whole = fetch(bucket, ref, tmp_path / "host-c-cache")
    assert (
        whole != served and (whole / STATE_FILE).read_bytes() == (version / STATE_FILE).read_bytes()
    )
