"""Issue 31's smaller holes in the web and service layer, each attacked as the issue found it:
a slot task sent by hand for a desktop, a checkpoint link swapped after its check, an
artifact key with a trailing newline, a viewer reading weights through /media, a body that
never ends, an open /health listing workers, and a password guessed without end."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.core.cache import cache
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.test import Client
from starlette.testclient import TestClient

from core.artifacts import ArtifactError, ArtifactRef, check_key, s3_client_config
from dartboard import body_limit, login_throttle
from datamanager.archive import MAX_UPLOAD_BYTES
from datamanager.config import RunConfig
from datamanager.models import EnvSlot, EvalJob, Run, Step, Task
from datamanager.roles import EnvNotGranted, run_env_check
from datamanager.services import runs as run_services
from datamanager.services.evaluations import eval_job_create
from rollout.auth import RequestRefused, ServiceTokens, bearer
from rollout.checkpoints import CheckpointSource
from rollout.router import build_app
from rollout.router_state import Router
from tests.conftest import png_bytes, user_in_role
from tests.dartboard.run_helpers import make_run
from tests.dartboard.test_curation_views import GOOD, archive, finished, upload
from workers.evaluation import eval_job_run
from workers.slot_worker import serve_slice
from workers.tasks import slot_serve

pytestmark = pytest.mark.django_db


# -- slot tasks: a desktop or a VM only for a run an admin gave them to ----------------------


def test_a_slot_task_sent_by_hand_gets_no_desktop_for_an_operators_run(researcher) -> None:
    """Flower's API (or anything reaching the broker) sends slot_serve for desktop slot 0 of
    an operator's run: the worker refuses before it registers a slot or starts a desktop."""
    run = make_run(owner=researcher)
    Task.objects.create(name="desk", env_kind="desktop", instruction="open a terminal")
    result = slot_serve.apply(args=(run.pk, "desktop", 0))
    assert result.failed() and isinstance(result.result, EnvNotGranted)
    assert (
        str(result.result) == f"run {run.pk} has no desktop slot 0 (it was given 0 desktop slots)"
    )
    with pytest.raises(EnvNotGranted):
        serve_slice(run_id=run.pk, backend="desktop", index=0, max_seconds=1)
    assert not EnvSlot.objects.filter(run=run).exists()


def test_a_vm_slot_needs_the_runs_vms_and_an_admin_owner(researcher, django_user_model) -> None:
    run = make_run(owner=researcher)
    with pytest.raises(
        EnvNotGranted, match=r"has no osworld slot 0 \(it was given 0 OSWorld VMs\)"
    ):
        run_env_check(run=run, backend="osworld", index=0)
    # Desktops written into an operator's run some other way than the run form: still not.
    given = {"env": {"desktop_slots": 1, "osworld_addresses": ["10.0.0.5:5000"]}}
    Run.objects.filter(pk=run.pk).update(config=RunConfig.from_dict(given).to_dict())
    run.refresh_from_db()
    for backend in ("desktop", "osworld"):
        with pytest.raises(EnvNotGranted) as refused:
            run_env_check(run=run, backend=backend, index=0)
        assert "belongs to ada, who does not hold the admin role" in str(refused.value)
    run_env_check(run=run, backend="miniwob", index=7)  # the policy gets no machine there
    admin = user_in_role(django_user_model, "grace", "admin")
    admins = run_services.run_create(name="a", config=RunConfig.from_dict(given), owner=admin)
    run_env_check(run=admins, backend="desktop", index=0)
    run_env_check(run=admins, backend="osworld", index=0)
    with pytest.raises(EnvNotGranted, match="has no desktop slot 1"):
        run_env_check(run=admins, backend="desktop", index=1)


def test_a_runs_evaluation_gets_no_vm_it_was_not_given(researcher) -> None:
    """An osworld task naming its own VM, evaluated inside an operator's run: refused, and
    the job says why."""
    run = make_run(owner=researcher)
    task = Task.objects.create(
        name="vm-task", env_kind="osworld", instruction="x", env_config={"address": _closed()}
    )
    job = eval_job_create(name="e", policy="oracle", tasks=[task], k=1, run_id=run.pk)
    with pytest.raises(EnvNotGranted):
        eval_job_run(job_id=job.pk)
    job = EvalJob.objects.get(pk=job.pk)
    assert job.status == "failed"
    assert job.error == f"EnvNotGranted: run {run.pk} was given no OSWorld VMs"
    assert not job.trajectories.exists()


def _closed() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# -- checkpoints and artifact keys ------------------------------------------------------------


def test_a_checkpoint_link_swapped_after_its_check_is_not_loaded(tmp_path: Path) -> None:
    root, outside = tmp_path / "checkpoints", tmp_path / "elsewhere"
    (root / "v1").mkdir(parents=True)
    outside.mkdir()
    link = root / "latest"
    link.symlink_to(root / "v1")
    source = CheckpointSource([root.resolve()])
    source.check(str(link))
    assert source.local(str(link)) == str((root / "v1").resolve())  # what is loaded
    link.unlink()
    link.symlink_to(outside)  # swapped between the reload's check and its load
    with pytest.raises(RequestRefused) as refused:
        source.local(str(link))
    assert refused.value.status == 403 and "outside the checkpoint roots" in str(refused.value)


def test_an_artifact_key_with_a_trailing_newline_is_refused() -> None:
    for key in ("runs/3/v12\n", "runs/3/v12\nartifacts/other", "\nruns/3"):
        with pytest.raises(ArtifactError, match="use segments of letters, digits"):
            check_key(key)
    with pytest.raises(ArtifactError):
        ArtifactRef.parse("artifact:runs/3/v12\n@" + "0" * 64)
    assert check_key("runs/3/v12") == "runs/3/v12"


# -- /media: screenshots only ----------------------------------------------------------------


@pytest.fixture
def s3_media(s3_server, settings, monkeypatch) -> Iterator[None]:
    """Media in the S3 bucket that also holds the artifact store, as docker-compose has it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    settings.STORAGES = {
        **settings.STORAGES,
        "default": {
            "BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {"bucket_name": "dartboard", "endpoint_url": s3_server.url,
                        "client_config": s3_client_config()},
        },
    }  # fmt: skip
    yield


@pytest.mark.parametrize("storage", ["filesystem", "s3"])
def test_media_serves_a_viewer_screenshots_and_never_weights(
    storage, viewer_client, ada_client, request
) -> None:
    if storage == "s3":
        request.getfixturevalue("s3_media")
    traj = finished(make_run())
    shot = traj.steps.get(index=0).screenshot.name
    files = {"s/0.png": png_bytes(), "s/1.png": png_bytes(color=(0, 0, 255))}
    assert upload(ada_client, archive(GOOD, files)).status_code == 302
    uploaded = Step.objects.filter(trajectory__source="precollected").first()
    assert (
        uploaded is not None
        and viewer_client.get(f"/media/{uploaded.screenshot.name}").status_code == 200
    )
    weights = default_storage.save("artifacts/runs/1/v1/model.safetensors", ContentFile(b"w8"))
    stray = default_storage.save(f"screenshots/x/traj-{traj.pk}/000.png", ContentFile(b"png"))
    served = viewer_client.get(f"/media/{shot}")
    assert served.status_code == 200 and served["Content-Type"] == "image/png"
    assert b"".join(served.streaming_content).startswith(b"\x89PNG")
    for key in (weights, stray, f"{shot}/../../../{weights}", "artifacts/"):
        assert viewer_client.get(f"/media/{key}").status_code == 404, key
    assert Client().get(f"/media/{shot}").status_code == 302  # to the login
    default_storage.delete(weights)
    default_storage.delete(stray)


# -- request bodies: refused while they stream ------------------------------------------------


def _post(
    path: str, chunks: int, *, declared: int | None = None, ends: bool = False
) -> tuple[int | None, int]:
    """POST `path` to the web's ASGI application, the body `chunks` chunks of 1 MiB; then the
    body ends (`ends`) or the client leaves. Returns (the status sent, the chunks read)."""
    from dartboard.asgi import application

    headers = [(b"host", b"testserver"), (b"content-type", b"application/octet-stream")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("testserver", 80)}  # fmt: skip
    read, sent, done = 0, [], False
    chunk = b"x" * 2**20

    async def receive() -> dict:
        nonlocal read, done
        if read < chunks:
            read += 1
            return {"type": "http.request", "body": chunk, "more_body": True}
        if ends and not done:
            done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if ends:  # the client stays connected until the response is over
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async_to_sync(application)(scope, receive, send)
    starts = [m["status"] for m in sent if m["type"] == "http.response.start"]
    return (starts[0] if starts else None), read


def test_a_declared_oversized_upload_is_refused_before_a_byte_is_read() -> None:
    limit = MAX_UPLOAD_BYTES + body_limit.FORM_SLACK_BYTES
    assert _post("/trajectories/upload/", 40, declared=limit + 1) == (413, 0)
    assert _post("/runs/new/", 40, declared=body_limit.DEFAULT_MAX_BYTES + 1) == (413, 0)


def test_a_body_without_a_length_is_cut_as_soon_as_it_passes_the_limit() -> None:
    """A chunked body that would go on for 64 MiB on a form page (limit 10 MiB): refused
    after the eleventh MiB, not spooled to the end."""
    status, read = _post("/accounts/login/", 64)
    assert status == 413
    assert read == body_limit.DEFAULT_MAX_BYTES // 2**20 + 1


def test_a_body_within_its_limit_reaches_the_dashboard() -> None:
    limit = MAX_UPLOAD_BYTES + body_limit.FORM_SLACK_BYTES
    status, read = _post("/trajectories/upload/", 3, declared=limit, ends=True)
    assert (status, read) == (403, 3)  # Django's answer (no CSRF token): the limit let it by


def test_the_proxy_limits_bodies_as_the_web_does() -> None:
    caddyfile = (Path(__file__).resolve().parents[2] / "deploy" / "Caddyfile").read_text()
    assert "request_body @upload {\n\t\tmax_size 257MiB" in caddyfile
    assert "request_body @other {\n\t\tmax_size 10MiB" in caddyfile
    assert (MAX_UPLOAD_BYTES + body_limit.FORM_SLACK_BYTES) == 257 * 2**20
    assert body_limit.DEFAULT_MAX_BYTES == 10 * 2**20


# -- the router's open /health ----------------------------------------------------------------


def test_the_routers_open_health_says_up_or_down_and_nothing_else() -> None:
    tokens = ServiceTokens(inference="i" * 32, admin="a" * 32)
    router = Router(tokens=tokens, wait_timeout=0.1)
    dead = f"http://{_closed()}"
    router.register(dead)
    client = TestClient(build_app(router, tokens=tokens))
    assert client.get("/health").json() == {"status": "down"}
    assert client.get("/health", headers=bearer("w" * 32)).json() == {"status": "down"}
    for token in (tokens.admin, tokens.inference):
        detailed = client.get("/health", headers=bearer(token)).json()
        assert detailed["status"] == "unavailable"
        assert [w["url"] for w in detailed["workers"]] == [dead]


# -- login throttling -------------------------------------------------------------------------


@pytest.fixture
def fresh_counts() -> Iterator[None]:
    cache.clear()
    yield
    cache.clear()


def _login(client: Client, password: str, *, address: str = "198.51.100.7", **extra):
    data = {"username": "ada", "password": password}
    return client.post("/accounts/login/", data, REMOTE_ADDR=address, **extra)


def test_guessing_a_password_is_stopped_after_five_failures(researcher, fresh_counts) -> None:
    client = Client()
    for _ in range(login_throttle.MAX_FAILURES):
        assert _login(client, "guess").status_code == 200
    refused = _login(client, "lovelace-pass-1")  # the right one, too late
    assert refused.status_code == 429
    assert 840 < int(refused["Retry-After"]) <= 900
    assert (
        "Too many failed logins as ada from your address: try again in 15 minutes."
        in refused.content.decode()
    )
    assert client.get("/").status_code == 302  # not logged in
    admin = client.post(
        "/admin/login/", {"username": "ada", "password": "x"}, REMOTE_ADDR="198.51.100.7"
    )
    assert "Too many failed logins as ada" in admin.content.decode()
    # Someone else at another address is not locked out by the guesser.
    assert _login(Client(), "lovelace-pass-1", address="198.51.100.8").status_code == 302


def test_a_successful_login_clears_the_count(researcher, fresh_counts) -> None:
    for _ in range(login_throttle.MAX_FAILURES - 1):
        _login(Client(), "typo")
    assert _login(Client(), "lovelace-pass-1").status_code == 302
    for _ in range(login_throttle.MAX_FAILURES - 1):
        assert _login(Client(), "typo").status_code == 200
    assert _login(Client(), "lovelace-pass-1").status_code == 302


def test_behind_the_proxy_the_address_is_the_one_the_proxy_wrote(
    researcher, fresh_counts, settings
) -> None:
    settings.DARTBOARD_TLS_PROXY = True
    proxy = "172.18.0.5"
    for _ in range(login_throttle.MAX_FAILURES):
        # A guesser's own X-Forwarded-For entry comes first; the proxy appends the address.
        _login(Client(), "guess", address=proxy, HTTP_X_FORWARDED_FOR="10.9.9.9, 203.0.113.5")
    locked = _login(Client(), "lovelace-pass-1", address=proxy, HTTP_X_FORWARDED_FOR="203.0.113.5")
    assert locked.status_code == 429
    other = _login(Client(), "lovelace-pass-1", address=proxy, HTTP_X_FORWARDED_FOR="203.0.113.6")
    assert other.status_code == 302
