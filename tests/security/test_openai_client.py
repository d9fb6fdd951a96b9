"""The official `openai` Python client against the inference server, the router and the vLLM
adapter (with the inference server as its OpenAI backend): a chat completion with an image and
log-probs, the model list, and every bad field refused with a 400 that names it. Real
processes on 127.0.0.1."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
from PIL import Image

from core.imaging import ImageGeometry
from rollout.auth import VLLM_KEY_ENV, client_token
from tests.conftest import png_bytes
from tests.helpers import free_port, needs
from tests.rollout.test_router import start_process, stop_process

# The client is slow to import: it is imported where it is used, so only the xdist worker
# that runs this module loads it (docs/tests.md, *Collection loads only what every module
# needs*).
if TYPE_CHECKING:
    import openai

pytestmark = pytest.mark.slow

MODEL = "tiny-policy"
MAX_PROMPT_TOKENS = 3000


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_message(png: bytes, text: str = "Click the submit button.") -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_url(png)}},
        ],
    }


def huge_canvas_png() -> bytes:
    """A 5000x5000 PNG of one colour: about 25 KB on the wire, 75 MB decoded."""
    buffer = io.BytesIO()
    Image.new("L", (5000, 5000), 255).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
@needs("live")
def endpoints(tiny_policy_dir) -> Iterator[dict[str, str]]:
    """The inference server, a router over it and a vLLM adapter fronting it, by name."""
    ports = {name: free_port() for name in ("server", "router", "adapter")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    procs = []
    try:
        procs.append(start_process(
            ["rollout.server", "--policy", str(tiny_policy_dir), "--port", str(ports["server"]),
             "--threads", "1", "--model-name", MODEL,
             "--max-prompt-tokens", str(MAX_PROMPT_TOKENS)],
            health_url=f"{urls['server']}/health",
        ))  # fmt: skip
        procs.append(start_process(
            ["rollout.router", "--port", str(ports["router"]), "--worker", urls["server"]],
            health_url=f"{urls['router']}/health",
        ))  # fmt: skip
        # The server stands in for vLLM: the adapter's key for it is the server's token.
        procs.append(start_process(
            ["rollout.vllm_adapter", "--vllm", urls["server"], "--port", str(ports["adapter"]),
             "--policy-dir", str(tiny_policy_dir)],
            health_url=f"{urls['adapter']}/health",
            env={VLLM_KEY_ENV: client_token(None) or ""},
        ))  # fmt: skip
        yield urls
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def client(url: str, token: str | None = None) -> openai.OpenAI:
    import openai

    return openai.OpenAI(
        base_url=f"{url}/v1", api_key=token or client_token(None), max_retries=0, timeout=120
    )


@pytest.mark.parametrize("name", ["server", "router", "adapter"])
def test_a_chat_completion_with_an_image_and_logprobs(endpoints, name) -> None:
    reply = client(endpoints[name]).chat.completions.create(
        model=MODEL,
        messages=[image_message(png_bytes())],  # type: ignore[list-item]
        max_tokens=6,
        temperature=1.0,
        seed=7,
        logprobs=True,
        top_logprobs=3,
    )
    choice = reply.choices[0]
    assert reply.model == MODEL and reply.object == "chat.completion"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert choice.logprobs is not None and choice.logprobs.content
    assert len(choice.logprobs.content) == reply.usage.completion_tokens
    for entry in choice.logprobs.content:
        assert entry.logprob <= 0 and bytes(entry.bytes or []).decode() == entry.token
        assert len(entry.top_logprobs) == 3 if name != "adapter" else len(entry.top_logprobs) >= 3
        assert max(t.logprob for t in entry.top_logprobs) >= entry.logprob - 1e-5
    # An image costs image tokens: the prompt is longer than its text alone.
    text_only = client(endpoints[name]).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Click the submit button."}],
        max_tokens=1,
    )
    assert reply.usage.prompt_tokens > text_only.usage.prompt_tokens + 10


@pytest.mark.parametrize("name", ["server", "router", "adapter"])
def test_the_model_list(endpoints, name) -> None:
    assert [m.id for m in client(endpoints[name]).models.list()] == [MODEL]


@pytest.mark.parametrize("name", ["server", "router", "adapter"])
def test_every_reply_carries_the_processors_image_geometry(endpoints, name, tiny_policy_dir):
    expected = ImageGeometry.from_policy_dir(tiny_policy_dir).to_json()
    reply = client(endpoints[name]).chat.completions.create(
        model="policy",  # what Dartboard's client sends: every backend serves its own model
        messages=[image_message(png_bytes())],  # type: ignore[list-item]
        max_tokens=2,
    )
    assert reply.model_extra and reply.model_extra["image_geometry"] == expected


BAD_FIELDS = {
    "seed": {"seed": 2**64},
    "temperature": {"temperature": 5},
    "top_p": {"top_p": 0},
    "max_tokens": {"max_tokens": 0},
    "top_logprobs": {"logprobs": True, "top_logprobs": 50},
    "n": {"n": 2},
    "logprobs": {"logprobs": "yes"},
}


def bad_messages() -> dict[str, list[dict]]:
    """Message lists each refused with param "messages", by what is wrong with them."""

    def image_url(url: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    return {
        "a URL the worker would have to fetch": image_url("http://127.0.0.1:9/a.png"),
        "an image that does not decode": image_url("data:image/png;base64,AAAA"),
        "a canvas past the pixel cap": [image_message(huge_canvas_png())],
        "seventeen images": [image_message(png_bytes(32, 32)) for _ in range(17)],
        "a prompt past the token cap": [
            {"role": "user", "content": "click " * 4 * MAX_PROMPT_TOKENS}
        ],
        "an unknown role": [{"role": "robot", "content": "hi"}],
        "no messages": [],
    }


@pytest.mark.parametrize("name", ["server", "router", "adapter"])
def test_each_bad_field_is_a_400_naming_it(endpoints, name) -> None:
    import openai

    api = client(endpoints[name])
    ok = [{"role": "user", "content": "hi"}]
    for field, extra in BAD_FIELDS.items():
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model=MODEL, messages=ok, **extra)  # type: ignore[call-overload]
        assert caught.value.param == field, (field, caught.value.message)
        assert field in caught.value.message
    for what, messages in bad_messages().items():
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
        assert caught.value.param == "messages", (what, caught.value.message)
    # None of it cost the worker anything: it still answers, at the same version.
    assert api.chat.completions.create(model=MODEL, messages=ok, max_tokens=2).choices  # type: ignore[arg-type]
    health = httpx.get(f"{endpoints['server']}/health").json()
    assert health["status"] == "ok" and health["in_flight"] == 0


def test_the_refusals_say_what_is_too_big(endpoints) -> None:
    import openai

    api = client(endpoints["server"])
    bad = bad_messages()
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=MODEL, messages=bad["a canvas past the pixel cap"])  # type: ignore[arg-type]
    assert "5000x5000 pixels" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=MODEL, messages=bad["seventeen images"])  # type: ignore[arg-type]
    assert "17 images; at most 16" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=MODEL, messages=bad["a prompt past the token cap"])  # type: ignore[arg-type]
    assert f"at most {MAX_PROMPT_TOKENS}" in caught.value.message


@pytest.mark.parametrize("name", ["server", "router", "adapter"])
def test_a_wrong_token_is_an_authentication_error(endpoints, name) -> None:
    import openai

    with pytest.raises(openai.AuthenticationError):
        client(endpoints[name], token="not-the-token-at-all-0123456789").models.list()
