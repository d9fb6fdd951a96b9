"""A transformers inference server speaking the OpenAI chat-completions subset the rollout
workers use, with dynamic batching and weight reload without a restart.

Run (CPU, tiny policy built with training.tiny_policy.build_tiny_policy):

    .venv/bin/python -m rollout.server --policy var/policies/tiny --port 8100 \\
        --host 127.0.0.1 --version 0 [--max-batch 8 --max-wait-ms 50 | --no-batching]

Endpoints:
- POST /v1/chat/completions: model, messages (inline data-URL images), max_tokens,
  temperature, top_p, seed, logprobs, top_logprobs, return_token_ids. The reply is an OpenAI
  chat.completion; each logprobs entry also carries `token_id`, and the body adds
  `policy_version` and `mean_entropy` (with return_token_ids, as vLLM does, the prompt's
  `prompt_token_ids`, image pads expanded, and the choice's `token_ids`). Log-probs are those of the model at temperature 1.
- POST /v1/reload {"version": int, "checkpoint": dir} or {"version": int, "weights":
  {"host", "port", "tag", "key"}}: loads the new weights beside the live ones while
  serving goes on (from the checkpoint, or pulled from the trainer's weight server over
  torch.distributed, `rollout.weight_receive`), then the generation thread swaps them in
  between two batches: nobody is drained or refused, a batch under way finishes on the
  weights it began with, and the version every reply reports is the one it was generated
  with. The reply: {"policy_version", "reload_s", "swap_ms" (how long generation paused),
  "source", "bytes"}. A LoRA adapter directory (`core.lora`) swaps only the adapter's weights
  (megabytes); its base must be the one served. A pull that fails (502; its error code
  `weight_server_unreachable` when the server took no connection) or does not fit this
  model (422) leaves the live weights and version as they were.
- GET /health: {"status": "ok", "policy_version", "reloading" (the version being loaded, or
  null), "swaps_live": true, "pulls_weights": true, "in_flight", "queued", "pid", ...};
  GET /v1/models: the served model (--model-name, else the directory's name).

Starlette on uvicorn (`rollout.asgi`): every route but /health needs a token
(DARTBOARD_INFERENCE_TOKEN; DARTBOARD_ADMIN_TOKEN for /v1/reload, `rollout.auth`), a
reload loads only from the checkpoint roots, bodies are capped and timed, and every field is
checked (seed range, finite numbers, at most MAX_IMAGES images of at most
`core.encoding.MAX_IMAGE_PIXELS` each, a prompt of at most --max-prompt-tokens); a refusal is
an OpenAI error body naming the field in `param`.

Dynamic batching: one background thread takes the first waiting request, takes whatever
else is queued, and waits up to max_wait_ms (default 50) for more only while the batch is
smaller than the number of requests recently in flight together (capped by max_batch);
then it runs one batched generate. A lone client is never held back, and closed-loop
clients that return a few ms apart after their batch share the next one. No Django here: this
runs on inference hosts without the database.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import logging
import math
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image
from starlette.requests import Request
from starlette.responses import Response

from core.artifacts import is_ref
from core.encoding import prompt_token_count, to_qwen_messages
from core.generation import generate
from core.policy import StagedWeights, install_weights, load_policy
from core.weight_wire import UNREACHABLE, WeightSource, WireError, WireMismatch, WireUnreachable
from rollout.asgi import (
    JSONReply,
    RequestError,
    TokenGate,
    bind,
    error_body,
    json_object,
    model_card,
    run_blocking,
    serve,
    worker_app,
)
from rollout.auth import ROOTS_ENV, ServiceTokens, checkpoint_roots, service_tokens
from rollout.checkpoints import CheckpointSource, add_store_options
from rollout.client import PROMPT_TOO_LONG
from rollout.limits import MAX_BATCH
from rollout.registration import add_registration_options, start_registration
from rollout.reloads import ReloadRefused, local_checkpoint, reload_request
from rollout.weight_receive import WeightReceiver

log = logging.getLogger("rollout.server")


@dataclass
class ChatRequest:
    """One validated chat-completions request waiting for its generation."""

    messages: list[dict[str, Any]]
    model: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool = False  # vLLM's flag: the prompt's and the reply's token ids
    images: list[Image.Image] = field(default_factory=list)  # decoded, in prompt order
    qwen_messages: list[dict[str, Any]] = field(default_factory=list)  # the template's form
    result: Any = None
    error: str | None = None
    on_done: Callable[[], object] | None = None  # called from the batch thread once it is answered


MAX_IMAGES = 16  # DART's prompts carry up to 5 screenshots


def parse_chat_request(
    body: Any, *, default_model: str, max_tokens_limit: int, max_images: int = MAX_IMAGES
) -> ChatRequest:
    """Validate a decoded JSON body, images decoded; raise RequestError with an exact
    message naming the field."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", param="messages")
    if body.get("stream"):
        raise RequestError("stream is not supported", param="stream")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1", param="n")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 256))
    if (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not 1 <= max_tokens <= max_tokens_limit
    ):
        raise RequestError(
            f"max_tokens must be an integer from 1 to {max_tokens_limit}", param="max_tokens"
        )
    temperature = body.get("temperature", 1.0)
    if not _is_number(temperature) or not 0 <= temperature <= 2:
        raise RequestError("temperature must be a number from 0 to 2", param="temperature")
    top_p = body.get("top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise RequestError("top_p must be a number in (0, 1]", param="top_p")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        # torch's generator takes 64 bits: a larger seed failed the whole batch it was in.
        raise RequestError("seed must be an integer from 0 to 2**63 - 1", param="seed")
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError("logprobs must be a boolean", param="logprobs")
    top_logprobs = body.get("top_logprobs") or 0
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= 20:
        raise RequestError("top_logprobs must be an integer from 0 to 20", param="top_logprobs")
    return_token_ids = body.get("return_token_ids", False)
    if not isinstance(return_token_ids, bool):
        raise RequestError("return_token_ids must be a boolean", param="return_token_ids")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise RequestError("model must be a string", param="model")
    # Decode images now, so a bad one is this client's 400 and not the batch's failure.
    try:
        qwen_messages, images = to_qwen_messages(messages)
    except ValueError as exc:
        raise RequestError(str(exc), param="messages") from exc
    if len(images) > max_images:
        raise RequestError(
            f"messages carry {len(images)} images; at most {max_images}", param="messages"
        )
    return ChatRequest(
        messages=messages,
        images=images,
        qwen_messages=qwen_messages,
        model=model,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        seed=seed,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        return_token_ids=return_token_ids,
    )


class ReloadBusy(RuntimeError):
    """Another reload runs on this worker (a 409)."""


@dataclass
class _Swap:
    """Staged weights queued for the generation thread, which swaps them in between two
    batches and sets `done`."""

    staged: StagedWeights
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0  # how long generation waited for the swap
    error: Exception | None = None


@dataclass(frozen=True)
class ReloadResult:
    """One finished reload, as POST /v1/reload answers it."""

    version: int
    seconds: float  # staging (read or pulled) and the swap
    swap_ms: float  # the part generation waited for
    source: str  # "checkpoint" or "weights"
    bytes: int  # pulled over the network (0 for a checkpoint)

    def to_json(self) -> dict[str, Any]:
        return {
            "policy_version": self.version,
            "reload_s": round(self.seconds, 3),
            "swap_ms": round(self.swap_ms, 3),
            "source": self.source,
            "bytes": self.bytes,
        }


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


class InferenceServer:
    """Holds the policy, the request queue, the batching thread and the reload state.

    The batching thread alone runs the model and swaps weights in (`_Swap` items on the
    queue), so a swap never meets a batch. `_cond` guards in_flight, version, reloading and
    the arrival log; `version` is written by the batching thread only.
    """

    CONCURRENCY_WINDOW_S = 2.0  # how far back "recently in flight together" looks

    def __init__(
        self,
        *,
        policy_dir: str,
        version: int = 0,
        device: str = "cpu",
        max_batch: int = MAX_BATCH,
        max_wait_ms: float = 50.0,
        max_tokens_limit: int = 1024,
        max_prompt_tokens: int = 32768,
        max_images: int = MAX_IMAGES,
        model_name: str | None = None,
    ):
        self.policy = load_policy(policy_dir, device=device)
        self.version = version
        self.max_batch = max(1, max_batch)
        self.max_wait_s = max_wait_ms / 1000
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self.max_images = max_images
        self.model_name = model_name or os.path.basename(os.path.normpath(policy_dir))
        self.reloading: int | None = None  # the version being loaded beside the live one
        self.last_swap_ms = 0.0
        self.in_flight = 0
        self.worker_name = ""
        self.busy_seconds = 0.0  # time spent generating (inference utilisation)
        self.batches_run = 0
        self.requests_served = 0
        self._queue: queue.Queue[ChatRequest | _Swap | None] = queue.Queue()
        self._cond = threading.Condition()
        self._reload_lock = threading.Lock()
        self.receiver = WeightReceiver()
        self._thread = threading.Thread(target=self._batch_loop, name="batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # --------------------------------------------------------- requests

    def parse(self, body: Any) -> ChatRequest:
        """A validated request whose prompt fits (RequestError otherwise). Decodes images and
        tokenizes: call off the event loop."""
        request = parse_chat_request(
            body,
            default_model=self.model_name,
            max_tokens_limit=self.max_tokens_limit,
            max_images=self.max_images,
        )
        tokens = prompt_token_count(self.policy, request.qwen_messages, request.images)
        if tokens > self.max_prompt_tokens:
            raise RequestError(
                f"the prompt takes {tokens} tokens (images included); at most "
                f"{self.max_prompt_tokens}",
                param="messages",
                code=PROMPT_TOO_LONG,
            )
        return request

    def submit(self, request: ChatRequest) -> None:
        """Queue a request (always taken: a reload never refuses one)."""
        with self._cond:
            self.in_flight += 1
            self._arrivals.append((time.monotonic(), self.in_flight))
        self._queue.put(request)

    def finish(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    @property
    def image_geometry(self) -> dict[str, int]:
        """The policy's image processor geometry (`core.imaging.ImageGeometry.to_json`)."""
        return self.policy.image_geometry.to_json()

    def health(self) -> dict[str, Any]:
        with self._cond:
            return {
                "status": "ok",
                "policy_version": self.version,
                "reloading": self.reloading,
                # What the router reads: no drain before a reload, and weights may be pulled.
                "swaps_live": True,
                "pulls_weights": True,
                "last_swap_ms": self.last_swap_ms,
                "in_flight": self.in_flight,
                "queued": self._queue.qsize(),
                "max_batch": self.max_batch,
                "batches_run": self.batches_run,
                "requests_served": self.requests_served,
                "busy_seconds": self.busy_seconds,
                "image_geometry": self.image_geometry,
                "model": self.model_name,
                "pid": os.getpid(),
            }

    def _batch_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            if isinstance(first, _Swap):
                self._install(first)
                continue
            batch, swap = [first], None
            # Wait (at most max_wait) only for as many requests as were recently in flight
            # together: closed-loop clients come back a few ms after their batch, and
            # waiting for them gives full batches; a lone client is never held back.
            target = min(self.max_batch, self._recent_concurrency())
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch:
                remaining = deadline - time.monotonic()
                try:
                    if len(batch) < target and remaining > 0:
                        item = self._queue.get(timeout=remaining)
                    else:
                        item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                if isinstance(item, _Swap):  # requests queued after it run on the new weights
                    swap = item
                    break
                batch.append(item)
            self._run_batch(batch)
            if swap is not None:
                self._install(swap)

    def _recent_concurrency(self) -> int:
        """The most requests in flight at once during the last CONCURRENCY_WINDOW_S."""
        with self._cond:
            horizon = time.monotonic() - self.CONCURRENCY_WINDOW_S
            while self._arrivals and self._arrivals[0][0] < horizon:
                self._arrivals.popleft()
            return max((n for _, n in self._arrivals), default=1)

    def _run_batch(self, batch: list[ChatRequest]) -> None:
        started = time.monotonic()
        version = self.version  # this thread alone swaps weights: these generate the batch
        try:
            gens = generate(
                self.policy,
                [r.messages for r in batch],
                max_new_tokens=[r.max_tokens for r in batch],
                temperature=[r.temperature for r in batch],
                top_p=[r.top_p for r in batch],
                seed=[r.seed for r in batch],
                top_logprobs=max(r.top_logprobs for r in batch),
            )
            with self._cond:
                self.batches_run += 1
                self.requests_served += len(batch)
                self.busy_seconds += time.monotonic() - started
            for request, gen in zip(batch, gens, strict=True):
                request.result = (gen, version)
        except Exception as exc:  # reported to every client of the batch, and logged
            log.exception("batch of %d failed", len(batch))
            for request in batch:
                request.error = f"generation failed: {type(exc).__name__}: {exc}"
        for request in batch:
            if request.on_done is not None:
                request.on_done()

    # --------------------------------------------------------- reload

    def reload(
        self, *, version: int, checkpoint: str | None = None, weights: WeightSource | None = None
    ) -> ReloadResult:
        """Stage `version` (read from `checkpoint`, or pulled from `weights`) while serving
        goes on, then have the generation thread swap it in between two batches.

        Raises ReloadBusy when another reload runs; WireError / WireMismatch for a failed pull,
        and whatever staging or the swap raised otherwise: the live weights and the version
        stay as they were then."""
        if not self._reload_lock.acquire(blocking=False):
            raise ReloadBusy("a reload is already running")
        started = time.monotonic()
        try:
            with self._cond:
                self.reloading = version
            swaps: list[_Swap] = []
            pulled = self.receiver.load(
                policy=self.policy,
                swap=lambda staged: swaps.append(self._swap(staged, version)),
                checkpoint=checkpoint,
                weights=weights,
                worker=self.worker_name,
            )
            return ReloadResult(
                version=version,
                seconds=time.monotonic() - started,
                swap_ms=swaps[0].seconds * 1000,
                source="weights" if weights is not None else "checkpoint",
                bytes=pulled,
            )
        finally:
            with self._cond:
                self.reloading = None
            self._reload_lock.release()

    def _swap(self, staged: StagedWeights, version: int) -> _Swap:
        """Queue `staged` for the generation thread and wait until it is swapped in; raise
        what the install raised."""
        swap = _Swap(staged, version)
        self._queue.put(swap)
        while not swap.done.wait(timeout=1.0):
            if not self._thread.is_alive():
                raise RuntimeError("the server is stopping: nothing was swapped in")
        if swap.error is not None:
            raise swap.error
        return swap

    def _install(self, swap: _Swap) -> None:
        """In the generation thread, between batches: swap the weights in, then the version
        (so every reply's version is the weights it was generated with)."""
        started = time.perf_counter()
        try:
            install_weights(self.policy, swap.staged)
            with self._cond:
                self.version = swap.version
        except Exception as exc:  # raised again by the reload that queued it
            log.exception("installing %s failed", swap.staged.source)
            swap.error = exc
        swap.seconds = time.perf_counter() - started
        with self._cond:
            self.last_swap_ms = swap.seconds * 1000
        swap.done.set()


def completion_body(request: ChatRequest, result: Any, *, server: InferenceServer) -> dict:
    """The OpenAI chat.completion JSON for one finished request."""
    gen, version = result
    tok = server.policy.tokenizer
    logprobs = None
    if request.logprobs:
        content = []
        for i, (tid, lp) in enumerate(zip(gen.token_ids, gen.token_logprobs, strict=True)):
            text = tok.decode([tid], skip_special_tokens=False)
            alternatives = (
                gen.top_logprobs[i][: request.top_logprobs] if request.top_logprobs else []
            )
            entry = {
                "token": text,
                "token_id": tid,
                "logprob": lp,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": tok.decode([t], skip_special_tokens=False),
                        "token_id": t,
                        "logprob": p,
                        "bytes": list(tok.decode([t], skip_special_tokens=False).encode("utf-8")),
                    }
                    for t, p in alternatives
                ],
            }
            content.append(entry)
        logprobs = {"content": content}
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": gen.text},
        "finish_reason": gen.finish_reason,
        "logprobs": logprobs,
    }
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.response_tokens,
            "total_tokens": gen.prompt_tokens + gen.response_tokens,
        },
        "policy_version": version,
        "mean_entropy": gen.mean_entropy,
        # The processor's geometry decides the model image size, hence what the coordinates
        # in the text mean: the client maps them back to the screen with it.
        "image_geometry": server.image_geometry,
    }
    if request.return_token_ids:  # as vLLM lays them out
        body["prompt_token_ids"] = gen.prompt_token_ids
        choice["token_ids"] = gen.token_ids
    return body


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # a client that timed out has cancelled it
        future.set_result(None)


def _reply(
    app: InferenceServer, body: dict, status: int = 200, headers: dict[str, str] | None = None
) -> JSONReply:
    headers = {"X-Dartboard-Worker": app.worker_name, **(headers or {})}
    return JSONReply(body, status, headers=headers)


def build_app(
    app: InferenceServer, *, tokens: ServiceTokens, source: CheckpointSource
) -> TokenGate:
    """The ASGI app serving `app` (module doc for the routes)."""

    request_timeout_s = 600.0

    async def health(_: Request) -> Response:
        return _reply(app, app.health())

    async def chat(http: Request) -> Response:
        body = await json_object(http)
        request = await run_blocking(app.parse, body)  # CPU work, off the event loop
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[None] = loop.create_future()
        request.on_done = functools.partial(loop.call_soon_threadsafe, _resolve, answered)
        app.submit(request)
        try:
            await asyncio.wait_for(answered, request_timeout_s)
        except TimeoutError:
            message = f"generation did not finish in {request_timeout_s:.0f} s"
            return _reply(app, error_body(504, message), 504)
        finally:
            app.finish()
        if request.error:
            return _reply(app, error_body(500, request.error), 500)
        return _reply(app, completion_body(request, request.result, server=app))

    async def models(_: Request) -> Response:
        return _reply(app, {"object": "list", "data": [model_card(app.model_name)]})

    async def reload(http: Request) -> Response:
        request = reload_request(await json_object(http), source)
        kept = f"kept version {app.version}"
        try:
            if request.weights is not None:
                result = await run_blocking(
                    app.reload, version=request.version, weights=request.weights
                )
            else:
                checkpoint = await run_blocking(local_checkpoint, request, source, kept=kept)
                result = await run_blocking(
                    app.reload, version=request.version, checkpoint=checkpoint
                )
        except ReloadBusy as exc:
            return _reply(app, error_body(409, str(exc)), 409)
        except ReloadRefused as exc:
            return _reply(app, error_body(exc.status, str(exc), param=exc.param), exc.status)
        except WireError as exc:
            status = 422 if isinstance(exc, WireMismatch) else 502
            message = f"weights not pulled, {kept}: {exc}"
            code = UNREACHABLE if isinstance(exc, WireUnreachable) else None
            return _reply(app, error_body(status, message, param="weights", code=code), status)
        except Exception as exc:
            log.exception("reload to version %d failed", request.version)
            message = f"reload failed, {kept}: {exc}"
            return _reply(app, error_body(500, message), 500)
        return _reply(app, result.to_json())

    endpoints = (health, models, chat, reload)
    return worker_app(endpoints, tokens=tokens, threads=(app.start, app.stop))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rollout.server", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--policy",
        required=True,
        help="model directory (tiny Qwen3-VL policy or a Qwen2-VL / 2.5-VL / 3-VL checkpoint), "
        "or an artifact reference (artifact:KEY@SHA256) fetched from the artifact store",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    parser.add_argument("--version", type=int, default=0, help="policy version now loaded")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch", type=int, default=MAX_BATCH)
    parser.add_argument(
        "--max-wait-ms", type=float, default=50.0, help="longest a request waits for batch-mates"
    )
    parser.add_argument("--no-batching", action="store_true", help="batch size 1 (benchmarks)")
    parser.add_argument("--max-tokens-limit", type=int, default=1024)
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=32768, help="longest prompt, images included"
    )
    parser.add_argument("--max-images", type=int, default=MAX_IMAGES, help="images per prompt")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--model-name", default=None, help="name echoed in replies")
    parser.add_argument(
        "--checkpoint-root",
        action="append",
        default=[],
        help=f"a directory reloads may load from (repeatable; else ${ROOTS_ENV}, else the "
        "directory holding --policy)",
    )
    add_registration_options(parser)
    add_store_options(parser)
    args = parser.parse_args(argv)
    tokens = service_tokens()
    served = None if is_ref(args.policy) else args.policy
    source = CheckpointSource(
        checkpoint_roots(args.checkpoint_root, served=served),
        store=args.artifacts,
        cache=args.artifact_cache,
    )
    source.check(args.policy)
    policy_dir = source.local(args.policy)  # an artifact reference is fetched and verified
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    app = InferenceServer(
        policy_dir=policy_dir,
        version=args.version,
        device=args.device,
        max_batch=1 if args.no_batching else args.max_batch,
        max_wait_ms=0 if args.no_batching else args.max_wait_ms,
        max_tokens_limit=args.max_tokens_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        max_images=args.max_images,
        model_name=args.model_name,
    )
    sock = bind(args.host, args.port)
    app.worker_name = f"{args.host}:{sock.getsockname()[1]}"
    start_registration(args, host=args.host, port=sock.getsockname()[1], token=tokens.admin)
    print(
        f"serving {args.policy} v{args.version} on http://{app.worker_name}",
        file=sys.stderr,
        flush=True,
    )
    serve(build_app(app, tokens=tokens, source=source), sock)


if __name__ == "__main__":
    main()
