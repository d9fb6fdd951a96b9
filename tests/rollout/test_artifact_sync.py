"""Inference hosts get their weights from the artifact store, not from the trainer's disk:
a worker starts from an artifact reference, reloads a newer version by reference (fetched
into its own cache and verified), and refuses a tampered upload while it keeps serving the
version it has. Real moto S3 server, real inference server process."""

from __future__ import annotations

import shutil

import httpx
import pytest

from core.artifacts import ArtifactRef, cached_copy, open_store, upload_dir
from rollout.auth import ADMIN_ENV, bearer, client_token
from rollout.checkpoints import SERVING_SKIPS
from rollout.client import RouterAdmin
from tests.helpers import free_port, wait_until
from tests.private_services import PrivateS3
from tests.rollout.test_router import start_process, stop_process

pytestmark = pytest.mark.slow

AUTH = bearer(client_token(None, ADMIN_ENV))  # reloads take the admin token


def test_a_worker_serves_versions_fetched_by_reference_and_refuses_a_tampered_one(
    s3_artifacts, s3_server, checkpoints, tmp_path, monkeypatch
):
    store = open_store(s3_artifacts)
    v0 = upload_dir(store, "runs/7/v00000", checkpoints[0])
    v1 = upload_dir(store, "runs/7/v00001", checkpoints[1])
    v2_dir = tmp_path / "v2"  # v0's weights again, but its own version (its own manifest)
    shutil.copytree(checkpoints[0], v2_dir)
    (v2_dir / "VERSION").write_text("2")
    v2 = upload_dir(store, "runs/7/v00002", v2_dir)
    cache = tmp_path / "host-c-cache"  # the inference host's own disk: nothing else on it
    monkeypatch.setenv("DARTBOARD_ARTIFACTS", s3_artifacts)
    monkeypatch.setenv("DARTBOARD_ARTIFACT_CACHE", str(cache))
    monkeypatch.setenv("DARTBOARD_CHECKPOINT_ROOTS", str(tmp_path / "no-local-checkpoints"))
    url = f"http://127.0.0.1:{free_port()}"
    port = url.rsplit(":", 1)[1]
    proc = start_process(
        ["rollout.server", "--policy", str(v0), "--port", port, "--threads", "1"],
        health_url=f"{url}/health",
    )
    try:
        assert (cached_copy(cache, v0, skip=SERVING_SKIPS) / "config.json").is_file()

        reply = httpx.post(f"{url}/v1/reload", json={"checkpoint": str(v1), "version": 1},
                           headers=AUTH, timeout=120)  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert httpx.get(f"{url}/health", timeout=5).json()["policy_version"] == 1
        weights = next(p.name for p in checkpoints[1].iterdir() if p.suffix == ".safetensors")
        assert (cached_copy(cache, v1, skip=SERVING_SKIPS) / weights).read_bytes() == (
            checkpoints[1] / weights
        ).read_bytes()

        # Someone rewrites v2's weights in the bucket after it was published.
        data = bytearray((checkpoints[0] / weights).read_bytes())
        data[-100] ^= 0x01
        s3_server.client().put_object(
            Bucket="dartboard", Key=f"artifacts/runs/7/v00002/{weights}", Body=bytes(data)
        )
        reply = httpx.post(f"{url}/v1/reload", json={"checkpoint": str(v2), "version": 2},
                           headers=AUTH, timeout=120)  # fmt: skip
        assert reply.status_code == 422
        error = reply.json()["error"]
        assert error["param"] == "checkpoint" and f"file {weights}" in error["message"]
        assert "kept version 1" in error["message"]
        assert httpx.get(f"{url}/health", timeout=5).json()["policy_version"] == 1
        assert not cached_copy(cache, v2, skip=SERVING_SKIPS).exists()

        # A reference is checked before any work: malformed, or to a worker without a store.
        bad = httpx.post(f"{url}/v1/reload", json={"checkpoint": "artifact:../x@00", "version": 3},
                         headers=AUTH, timeout=10)  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "checkpoint"
    finally:
        stop_process(proc)


def test_a_store_outage_delays_a_version_and_never_drops_it(checkpoints, tmp_path, monkeypatch):
    """The store restarts while the router syncs a version: the worker answers 503 (the store
    did not answer), keeps serving what it has, and the router gives it the version again
    once the store is back (an unreadable or tampered version is never retried: above)."""
    s3 = PrivateS3()
    s3.start()
    procs = []
    try:
        for name, value in s3.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("DARTBOARD_ARTIFACTS", "s3://outage/artifacts")
        monkeypatch.setenv("DARTBOARD_ARTIFACT_CACHE", str(tmp_path / "cache"))

        def publish() -> tuple[ArtifactRef, ArtifactRef]:
            s3.client().create_bucket(Bucket="outage")
            store = open_store("s3://outage/artifacts")
            return (upload_dir(store, "runs/1/v00000", checkpoints[0]),
                    upload_dir(store, "runs/1/v00001", checkpoints[1]))  # fmt: skip

        v0, v1 = publish()
        worker = f"http://127.0.0.1:{free_port()}"
        procs.append(start_process(
            ["rollout.server", "--policy", str(v0), "--port", worker.rsplit(":", 1)[1],
             "--threads", "1"], health_url=f"{worker}/health",
        ))  # fmt: skip
        router_port = free_port()
        router = f"http://127.0.0.1:{router_port}"
        procs.append(start_process(
            ["rollout.router", "--port", str(router_port), "--probe-interval", "0.5",
             "--worker", worker], health_url=f"{router}/health",
        ))  # fmt: skip
        admin = RouterAdmin(router)
        wait_until(lambda: admin.workers()[0].status == "active", timeout=60, what="active")

        s3.stop()
        admin.sync(checkpoint=str(v1), version=1, run=1)
        wait_until(lambda: "unreachable" in admin.workers()[0].last_error, timeout=60,
                   what="the reload refused while the store is down")  # fmt: skip
        state = admin.workers()[0]
        assert state.policy_version == 0  # it kept serving what it had
        assert "503" in state.last_error or "kept version 0" in state.last_error

        s3.start()  # back, empty (moto keeps nothing): the trainer's upload is retried
        assert publish()[1] == v1
        wait_until(lambda: admin.workers()[0].policy_version == 1, timeout=60,
                   what="the version given again once the store answered")  # fmt: skip
        admin.close()
    finally:
        for proc in procs:
            stop_process(proc)
        s3.stop()
