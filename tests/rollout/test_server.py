"""The transformers inference server, run as a real subprocess on the tiny policy."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageDraw

from rollout.auth import ADMIN_ENV, bearer, client_token
from rollout.client import InferenceUnavailable, PolicyClient
from tests.helpers import free_port, needs, wait_until
from tests.rollout.test_router import start_process, stop_process

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def screenshot_url() -> str:
    image = Image.new("RGB", (160, 210), "white")
    ImageDraw.Draw(image).rectangle([20, 150, 100, 180], fill="blue")
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Click the submit button."},
            {"type": "image_url", "image_url": {"url": screenshot_url()}},
        ],
    }
]


AUTH = bearer(client_token(None))  # the test settings' inference token
ADMIN = bearer(client_token(None, ADMIN_ENV))  # and their admin token (/v1/reload)


@pytest.fixture(scope="module")
@needs("live")
def server(checkpoints):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_process(
        [
            *("rollout.server", "--policy", str(checkpoints[0])),
            *("--port", str(port), "--version", "0", "--threads", "1"),
        ],
        health_url=f"{url}/health",
    )
    yield url
    stop_process(proc)


def test_concurrent_clients_get_sampled_answers_with_policy_version(server):
    results, errors = [], []

    def ask(seed: int) -> None:
        try:
            with PolicyClient(server, timeout=60) as client:
                results.append(client.complete(MESSAGES, max_tokens=8, seed=seed))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(results) == 4
    for c in results:
        assert c.policy_version == 0
        assert c.response_tokens == len(c.token_logprobs) == len(c.token_ids) >= 1
        assert c.mean_entropy > 0
        assert c.prompt_tokens > 48
        assert c.served_by.endswith(server.rsplit(":", 1)[1])
    health = httpx.get(f"{server}/health").json()
    assert health["in_flight"] == 0 and health["status"] == "ok"


def test_malformed_requests_get_400_naming_the_field(server):
    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("request body is not valid JSON")

    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, json={"model": "tiny"})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "messages must be a non-empty list",
        "type": "invalid_request_error",
        "param": "messages",
        "code": 400,
    }
    r = httpx.post(
        f"{server}/v1/chat/completions", headers=AUTH, json={"messages": MESSAGES, "top_p": 0}
    )
    assert r.json()["error"]["message"] == "top_p must be a number in (0, 1]"
    bad_image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, json={"messages": bad_image})
    assert r.status_code == 400
    assert "messages[0].content[0].image_url.url" in r.json()["error"]["message"]


def test_client_skips_a_dead_worker_and_gives_up_clearly(server):
    dead = f"http://127.0.0.1:{free_port()}"
    with PolicyClient([dead, server], timeout=30) as client:
        for _ in range(2):  # round-robin start: one of the two calls begins at the dead one
            assert client.complete(MESSAGES, max_tokens=2).text is not None
    with (
        PolicyClient([dead], timeout=1) as client,
        pytest.raises(InferenceUnavailable, match="no inference worker answered within 1 s"),
    ):
        client.complete(MESSAGES, max_tokens=2)


def test_reload_swaps_in_place_while_serving_and_refuses_nobody(server, checkpoints):
    """Before, during and after one reload, on the same server process (long: the three
    phases are one story, and requests in flight span them)."""
    pid = httpx.get(f"{server}/health").json()["pid"]
    greedy = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}
    before = httpx.post(
        f"{server}/v1/chat/completions", headers=AUTH, json=greedy, timeout=60
    ).json()

    stop = threading.Event()
    done, errors = [], []

    def loop() -> None:
        with PolicyClient(server, timeout=60) as client:
            while not stop.is_set():
                try:
                    done.append(client.complete(MESSAGES, max_tokens=6))
                except Exception as exc:
                    errors.append(exc)

    workers = [threading.Thread(target=loop) for _ in range(3)]
    for w in workers:
        w.start()
    wait_until(lambda: len(done) >= 3)
    # One long request, accepted before the reload: it is generated before the swap.
    long_reply: list[httpx.Response] = []
    long = threading.Thread(
        target=lambda: long_reply.append(
            httpx.post(
                f"{server}/v1/chat/completions",
                headers=AUTH,
                json={"messages": MESSAGES, "max_tokens": 200},
                timeout=120,
            )
        )
    )
    long.start()
    # Accepted once in_flight exceeds what the three closed-loop clients can hold.
    wait_until(lambda: httpx.get(f"{server}/health").json()["in_flight"] >= 4)
    reload_reply: list[httpx.Response] = []
    reloader = threading.Thread(
        target=lambda: reload_reply.append(
            httpx.post(
                f"{server}/v1/reload",
                headers=ADMIN,
                json={"checkpoint": str(checkpoints[1]), "version": 1},
                timeout=120,
            )
        )
    )
    # A probe watches the health endpoint while the reload runs and asks for a completion
    # the moment the worker says it is loading the new version: it is answered.
    probes: list[httpx.Response] = []

    def probe() -> None:
        with httpx.Client(timeout=60) as client:
            while reloader.is_alive() and not probes:
                if client.get(f"{server}/health").json()["reloading"] == 1:
                    probes.append(client.post(f"{server}/v1/chat/completions", headers=AUTH,
                                              json={"messages": MESSAGES, "max_tokens": 1}))  # fmt: skip

    reloader.start()
    prober = threading.Thread(target=probe)
    prober.start()
    reloader.join()
    prober.join()
    long.join()
    n_after = len(done)
    wait_until(lambda: len(done) >= n_after + 3)
    stop.set()
    for w in workers:
        w.join()

    assert [r.status_code for r in probes] == [200]  # served while loading, never refused
    assert probes[0].json()["policy_version"] in (0, 1)
    assert reload_reply[0].status_code == 200
    reloaded = reload_reply[0].json()
    assert reloaded["policy_version"] == 1 and reloaded["source"] == "checkpoint"
    assert 0 <= reloaded["swap_ms"] <= reloaded["reload_s"] * 1000
    assert long_reply[0].status_code == 200  # accepted before the swap: the old weights
    assert long_reply[0].json()["policy_version"] == 0
    assert errors == []
    assert {c.policy_version for c in done} == {0, 1}
    health = httpx.get(f"{server}/health").json()
    assert health["pid"] == pid and health["policy_version"] == 1
    after = httpx.post(
        f"{server}/v1/chat/completions", headers=AUTH, json=greedy, timeout=60
    ).json()
    assert after["policy_version"] == 1
    assert [t["logprob"] for t in after["choices"][0]["logprobs"]["content"]] != [
        t["logprob"] for t in before["choices"][0]["logprobs"]["content"]
    ]
