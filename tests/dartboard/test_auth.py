"""Nothing is visible or changeable without a login: pages, media, admin and WebSockets."""

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.core.files.storage import default_storage
from django.test import Client

from dartboard.asgi import application
from tests.dartboard.run_helpers import make_run
from tests.dartboard.test_curation_views import finished

pytestmark = pytest.mark.django_db

PAGES = ["/", "/runs/1/", "/media/screenshots/x.png", "/vendor/plotly.min.js", "/groups/1/",
         "/runs/1/labels/", "/labels.jsonl", "/evaluations/compare/episodes/?a=1&b=2&task=t&seed=0"]  # fmt: skip


@pytest.mark.parametrize("url", PAGES)
def test_anonymous_is_sent_to_login(client, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=")


def test_admin_needs_login(client):
    assert client.get("/admin/").status_code == 302


def test_login_then_dashboard(client, researcher):
    response = client.post("/accounts/login/", {"username": "ada", "password": "lovelace-pass-1"})
    assert response.status_code == 302
    page = client.get("/")
    assert page.status_code == 200
    assert b"No runs yet." in page.content


def test_wrong_password_stays_on_login(client, researcher):
    response = client.post("/accounts/login/", {"username": "ada", "password": "nope"})
    assert response.status_code == 200
    assert b"Please enter a correct username and password" in response.content


def test_media_served_to_logged_in_users_only(ada_client):
    traj = finished(make_run())
    key = traj.steps.get(index=0).screenshot.name
    assert Client().get(f"/media/{key}").status_code == 302
    response = ada_client.get(f"/media/{key}")
    with default_storage.open(key, "rb") as stored:
        assert response.status_code == 200
        assert b"".join(response.streaming_content) == stored.read()
    assert ada_client.get("/media/screenshots/none.png").status_code == 404


def test_health_is_public(client):
    assert client.get("/health/").json() == {"status": "ok"}


def _ws_connect(headers):
    async def go():
        comm = WebsocketCommunicator(application, "/ws/runs/1/", headers=headers)
        connected, code = await comm.connect()
        await comm.disconnect()
        return connected, code

    return async_to_sync(go)()


@pytest.mark.django_db(transaction=True)
def test_websocket_rejects_anonymous_and_accepts_a_session(client, researcher):
    origin = [(b"origin", b"http://127.0.0.1")]
    connected, code = _ws_connect(origin)
    assert not connected and code == 4401
    client.force_login(researcher)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    connected, _ = _ws_connect([*origin, (b"cookie", cookie)])
    assert connected
