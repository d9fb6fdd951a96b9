"""The clients of the rollout services: `PolicyClient`, which the episode runner calls (one
OpenAI chat-completions request per step), and `RouterAdmin`, the router's admin API.

    client = PolicyClient(["http://127.0.0.1:8100", "http://127.0.0.1:8101"], timeout=60)
    completion = client.complete(messages, max_tokens=256, temperature=1.0)

It speaks to the transformers server (rollout.server), a vLLM OpenAI server or a router
in front of several. A 503 (worker draining for a weight reload), a 502/504 or a
connection failure is retried on the next URL (the same one after a short pause when only
one is given) until `timeout` seconds have passed, then `InferenceUnavailable` is raised.
Any other error status raises `InferenceError` with the server's message, unretried; a prompt
refused for its length, `PromptTooLong` (the episode drops more history and asks again).

    admin = RouterAdmin("http://127.0.0.1:8100")
    admin.register("http://127.0.0.1:8101")
    admin.sync("/path/to/checkpoint", 3)
    admin.wait_for_version(3, timeout=300)

`WorkerStatus` and `WorkerInfo` are what the admin API says about a worker: the router's state
machine (rollout.router_state) records them and RouterAdmin reads them back. They live here
so that importing a client loads neither the router nor Starlette.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Self

import httpx

from core.completion import Completion
from core.imaging import ImageGeometry
from rollout.auth import ADMIN_ENV, bearer, client_token

if TYPE_CHECKING:
    from core.weight_wire import WeightSource

RETRYABLE_STATUS = frozenset({502, 503, 504})


class InferenceError(Exception):
    """The server rejected or failed a request; the message is the server's."""


class InferenceUnavailable(InferenceError):
    """No worker answered within the client's timeout."""


PROMPT_TOO_LONG = "context_length_exceeded"
"""The error `code` of a prompt refused for its length (OpenAI's): `rollout.server` and the
vLLM adapter answer such a 400 with it."""


class PromptTooLong(InferenceError):
    """The server refused the prompt for its length; the message is the server's."""


class WorkerStatus(StrEnum):
    """An inference worker's status in the router (rollout.router_state)."""

    ACTIVE = "active"  # routed
    STALE = "stale"  # healthy but behind the target version, waiting for its reload
    DRAINING = "draining"  # no new requests while its in-flight ones finish
    LOADING = "loading"  # reloading weights
    SUSPECT = "suspect"  # answered 503 or timed out
    DEAD = "dead"  # refused the connection


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as GET /admin/workers reports it."""

    url: str
    status: WorkerStatus
    in_flight: int
    policy_version: int | None
    served: int
    failures: int
    last_error: str

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> WorkerInfo:
        return cls(**{**body, "status": WorkerStatus(body["status"])})


class _HttpClient:
    """Closing and the `with` block, for a client over one httpx.Client."""

    _http: httpx.Client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PolicyClient(_HttpClient):
    """Thread-safe client over one or several inference base URLs (or one router URL)."""

    def __init__(
        self,
        base_urls: str | list[str],
        *,
        timeout: float = 60.0,
        model: str = "policy",
        token: str | None = None,
    ):
        """`token`: the inference token (default: DARTBOARD_INFERENCE_TOKEN)."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("PolicyClient needs at least one base URL")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        self.model = model
        self._http = httpx.Client(timeout=timeout, headers=bearer(client_token(token)))
        self._next = itertools.cycle(range(len(self.base_urls)))
        self._lock = threading.Lock()

    def complete(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        top_logprobs: int = 0,
    ) -> Completion:
        """Send one chat completion; retry elsewhere on 503/connection errors (see module)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": True,
            # vLLM: tokens come back as "token_id:N"; rollout.server sends token_id anyway.
            "return_tokens_as_token_ids": True,
            # The prompt's token ids in the reply (`prompt_token_ids`): the step stores
            # them and the trainer trains on them (vLLM >= 0.10.2 and rollout.server).
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        if top_logprobs:
            body["top_logprobs"] = top_logprobs
        started = time.monotonic()
        deadline = started + self.timeout
        with self._lock:
            first = next(self._next)
        order = [
            self.base_urls[(first + i) % len(self.base_urls)] for i in range(len(self.base_urls))
        ]
        errors: list[str] = []
        for attempt in itertools.count():
            url = order[attempt % len(order)]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                response = self._http.post(
                    f"{url}/v1/chat/completions", json=body, timeout=remaining
                )
            except httpx.HTTPError as exc:
                errors.append(f"{url}: {type(exc).__name__}: {exc}")
            else:
                if response.status_code == 200:
                    latency_ms = (time.monotonic() - started) * 1000
                    served_by = response.headers.get("X-Dartboard-Worker") or url
                    return _parse_completion(response.json(), latency_ms, served_by)
                message = _error_message(response)
                if _error_code(response) == PROMPT_TOO_LONG:
                    raise PromptTooLong(f"{url} answered {response.status_code}: {message}")
                if response.status_code not in RETRYABLE_STATUS:
                    raise InferenceError(f"{url} answered {response.status_code}: {message}")
                errors.append(f"{url}: {response.status_code} {message}")
            if (attempt + 1) % len(order) == 0:
                # Every worker refused once: wait a little before the next round.
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        raise InferenceUnavailable(
            f"no inference worker answered within {self.timeout:g} s "
            f"({len(errors)} attempts; last: {errors[-1] if errors else 'none'})"
        )


class RouterAdmin(_HttpClient):
    """The router's admin API from Python (launcher, trainer); usage in the module doc."""

    def __init__(self, base_url: str, *, timeout: float = 30.0, token: str | None = None):
        """`token`: the admin token (default: DARTBOARD_ADMIN_TOKEN)."""
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(timeout=timeout, headers=bearer(client_token(token, ADMIN_ENV)))

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, f"{self.base_url}{path}", **kwargs)
        if response.status_code >= 400:
            message = _error_message(response)
            raise RuntimeError(f"router answered {response.status_code}: {message}")
        return response.json()

    def register(self, url: str) -> WorkerInfo:
        return WorkerInfo.from_json(self._call("POST", "/admin/workers", json={"url": url}))

    def unregister(self, url: str) -> None:
        self._call("DELETE", "/admin/workers", params={"url": url})

    def sync(
        self,
        checkpoint: str,
        version: int,
        *,
        run: int | None = None,
        rolling: bool = True,
        weights: WeightSource | None = None,
    ) -> dict[str, Any]:
        """Publish `version` (of `run`); returns at once, the rollout runs in the router.
        `weights`: the trainer's weight server holding it (workers pull it from there)."""
        body: dict[str, Any] = {
            "checkpoint": str(checkpoint),
            "version": version,
            "rolling": rolling,
        }
        if run is not None:
            body["run"] = run
        if weights is not None:
            body["weights"] = weights.to_json()
        return self._call("POST", "/admin/sync", json=body)

    def workers(self) -> list[WorkerInfo]:
        return [WorkerInfo.from_json(w) for w in self._call("GET", "/admin/workers")]

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def wait_for_version(self, version: int, *, timeout: float = 300.0) -> list[WorkerInfo]:
        """Block until every live worker is active at `version` or newer."""
        deadline = time.monotonic() + timeout
        while True:
            workers = self.workers()
            live = [w for w in workers if w.status != WorkerStatus.DEAD]
            if live and all(
                w.status == WorkerStatus.ACTIVE and (w.policy_version or 0) >= version for w in live
            ):
                return workers
            if time.monotonic() > deadline:
                states = ", ".join(f"{w.url} {w.status} v{w.policy_version}" for w in workers)
                raise TimeoutError(f"workers did not reach v{version} in {timeout:g} s: {states}")
            time.sleep(0.2)


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except Exception:
        return response.text[:200]


def _error_code(response: httpx.Response) -> object:
    try:
        return response.json()["error"]["code"]
    except Exception:
        return None


def _parse_completion(body: dict[str, Any], latency_ms: float, served_by: str) -> Completion:
    choice = body["choices"][0]
    content = (choice.get("logprobs") or {}).get("content") or []
    token_ids = [_token_id(entry) for entry in content]
    mean_entropy = body.get("mean_entropy")
    if mean_entropy is None:
        mean_entropy = _entropy_from_top_logprobs(content)
    usage = body.get("usage") or {}
    return Completion(
        text=choice["message"]["content"] or "",
        token_ids=[t for t in token_ids if t is not None] if None not in token_ids else [],
        token_logprobs=[float(entry["logprob"]) for entry in content],
        mean_entropy=float(mean_entropy),
        policy_version=body.get("policy_version"),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        response_tokens=int(usage.get("completion_tokens", len(content))),
        finish_reason=choice.get("finish_reason") or "stop",
        latency_ms=latency_ms,
        served_by=served_by,
        image_geometry=(
            ImageGeometry.from_json(body["image_geometry"]) if body.get("image_geometry") else None
        ),
        prompt_token_ids=_prompt_token_ids(body.get("prompt_token_ids")),
    )


def _prompt_token_ids(value: Any) -> tuple[int, ...]:
    """The reply's prompt token ids; () when the server sent none. A list that is not all
    integers is the server's error, not something to store and train on."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise InferenceError("the server's prompt_token_ids is not a list of token ids")
    return tuple(value)


def _token_id(entry: dict[str, Any]) -> int | None:
    if isinstance(entry.get("token_id"), int):
        return entry["token_id"]
    token = entry.get("token", "")
    if token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    return None


def _entropy_from_top_logprobs(content: list[dict[str, Any]]) -> float:
    """Entropy estimate for servers without `mean_entropy` (vLLM): the top-k alternatives
    renormalised, a lower bound of the true entropy; NaN without top_logprobs."""
    per_token = []
    for entry in content:
        top = [float(t["logprob"]) for t in entry.get("top_logprobs") or []]
        if not top:
            return math.nan
        z = math.log(sum(math.exp(x) for x in top))
        per_token.append(-sum(math.exp(x - z) * (x - z) for x in top))
    return sum(per_token) / len(per_token) if per_token else math.nan
