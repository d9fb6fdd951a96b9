"""Put a `vllm serve` process behind Dartboard's inference-worker contract.

    (the command in docs/scaling-out.md and docker-compose.yml's `vllm` service)
    python -m rollout.vllm_adapter --vllm http://127.0.0.1:8200 --policy-dir /models/policy \\
        --port 8101 --version 0
    (the launcher's: vLLM on a unix socket in a 0700 directory, `vllm serve --uds PATH`)
    python -m rollout.vllm_adapter --vllm unix:/path/to/vllm.sock ...

The adapter answers like `rollout.server`, so the router and the env slots cannot tell the
difference: POST /v1/chat/completions is checked field by field as `rollout.server` checks it
(`parse_chat_request`: a bad field is a 400 naming it, before vLLM sees anything), then passed
through asking vLLM for per-token logprobs and top-5 alternatives (from which the client
estimates the entropy), and the reply gains `policy_version` (vLLM's refusal of a prompt
past its --max-model-len gains `rollout.server`'s error code for it, `context_length_exceeded`);
POST /v1/reload {"checkpoint", "version"} with a LoRA adapter directory loads it into vLLM
beside the serving one (/v1/load_lora_adapter), sends new requests to it at once and unloads
the old adapter when its last request ends: no pause. Full weights drain, reload in place
(/collective_rpc, vLLM's `reload_weights`), then reset vLLM's prefix and multimodal caches
(entries computed by the old weights would otherwise mix into new generations silently).
POST /v1/reload {"weights", "version"} pulls the version from the trainer's weight server
into vLLM's own process (`rollout.vllm_weights`, vLLM's worker extension) where vLLM was
started with it (/health says `pulls_weights`): the next LoRA adapter while one is served,
switched to as above, else full weights, drained and loaded in place as above. A pull that
fails (502; code `weight_server_unreachable` when the server took no connection) or does
not fit (422) leaves vLLM's weights and the version as they were. GET /v1/models is vLLM's list;
GET /health reports status, version, served name, image geometry (from the processor of
--policy-dir, also in every reply) and in-flight requests. Requests name Dartboard's model;
the adapter asks vLLM for what it serves now (the base's --served-model-name or the current
adapter).

Starlette on uvicorn (`rollout.asgi`): every route but /health needs a token (the inference
token; the admin token for /v1/reload) and a reload loads only from the checkpoint roots
(`rollout.auth`). vLLM's API key (VLLM_API_KEY, read by vLLM itself and by this adapter) guards
only its /v1/* routes: its dev-mode /collective_rpc, /reset_*_cache and the rest answer anyone
who can connect. So vLLM is reachable only from this adapter: on a unix socket in a
directory only this user can enter (the launcher), or on a network only the adapter joins
(compose). The suite runs it in front of vLLM's CPU build (`tests/rollout/test_vllm_cpu.py`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from core.generation import NEVER_GENERATED
from core.imaging import ImageGeometry
from core.lora import is_adapter_dir
from core.replies import reply_text, stop_token_ids
from core.weight_wire import UNREACHABLE, WeightSource
from rollout.asgi import (
    JSONReply,
    TokenGate,
    bind,
    error_body,
    error_reply,
    json_object,
    run_blocking,
    serve,
    worker_app,
)
from rollout.auth import (
    VLLM_KEY_ENV,
    ServiceTokens,
    bearer,
    checkpoint_roots,
    service_tokens,
)
from rollout.checkpoints import CheckpointSource, add_store_options
from rollout.client import PROMPT_TOO_LONG
from rollout.registration import add_registration_options, start_registration
from rollout.reloads import ReloadRefused, local_checkpoint, reload_request
from rollout.server import MAX_IMAGES, parse_chat_request

log = logging.getLogger("rollout.vllm_adapter")


def vllm_base(url: str) -> tuple[str, httpx.HTTPTransport | None]:
    """The base URL requests to vLLM use, and the transport: a unix socket for unix:/PATH
    (requests then name a placeholder host; the socket is what connects)."""
    if url.startswith("unix:"):
        path = url.removeprefix("unix:").removeprefix("//")
        if not path.startswith("/"):
            raise ValueError(f"--vllm {url!r}: give the socket as unix:/absolute/path")
        return "http://vllm", httpx.HTTPTransport(uds=path)
    return url.rstrip("/"), None


class Adapter:
    """Status, version, served name and in-flight counts of one vLLM server; `cond` guards
    them. Requests are counted per policy version, so an adapter switch waits only for the
    requests still on the old adapter."""

    def __init__(
        self,
        vllm_url: str,
        version: int,
        *,
        token: str | None,
        geometry: ImageGeometry,
        max_tokens_limit: int = 1024,
        max_images: int = MAX_IMAGES,
        never_generated: tuple[int, ...] = (),
        stop_ids: tuple[int, ...] = (),
        tokenizer: Any = None,
        name: str = "",
        pull_timeout_s: float = 120.0,
    ) -> None:
        """`vllm_url`: http://HOST:PORT, or unix:/PATH for vLLM on a unix socket (`vllm serve
        --uds PATH`). `token`: vLLM's API key (its VLLM_API_KEY). `geometry` is the served
        model's processor's (`--policy-dir`): clients map coordinates with it. `never_generated`:
        the token ids no reply may contain (`core.generation.NEVER_GENERATED`). `stop_ids` and
        `tokenizer`: where a reply ends and how its tokens become its text
        (`core.replies`), as the transformers server does. `name`: this worker in the weight
        server's log; `pull_timeout_s`: the longest wait of a pull (an answer, a window)."""
        self.vllm, transport = vllm_base(vllm_url)
        self.version = version
        self.geometry = geometry
        self.max_tokens_limit = max_tokens_limit
        self.max_images = max_images
        self.never_generated = never_generated
        self.stop_ids = stop_ids
        self.tokenizer = tokenizer
        self.name = name
        self.pull_timeout_s = pull_timeout_s
        self.pulls: bool | None = None  # vLLM runs the worker extension (asked once it is up)
        self.adapter_dir: str | None = None  # the serving LoRA adapter's directory, if known
        self.model = ""  # vLLM's served name of the base model (--served-model-name)
        self.serving = ""  # what requests ask vLLM for: the base, or the current LoRA adapter
        self.status = "ok"
        self.in_flight: collections.Counter[int] = collections.Counter()  # by policy version
        self.cond = threading.Condition()
        self.http = httpx.Client(timeout=600, headers=bearer(token), transport=transport)

    def start(self) -> None:
        """Learn the served model's name (what every request asks vLLM for), if vLLM is up;
        else the first request or reload learns it (`base_name`)."""
        try:
            self.base_name()
        except ValueError as exc:
            print(exc, file=sys.stderr, flush=True)

    def base_name(self) -> str:
        """vLLM's name of the base model (its --served-model-name), asked once it answers;
        ValueError while it lists none (still starting)."""
        if self.model:
            return self.model
        try:
            listed = self.http.get(f"{self.vllm}/v1/models", timeout=10).json()
            name = listed["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"vLLM at {self.vllm} lists no model yet: {exc}") from exc
        try:  # vLLM started without the extension answers 500: checkpoints only
            pulls = self._rpc("dartboard_pulls") == (200, {"pulls": True})
        except httpx.HTTPError:
            pulls = False
        with self.cond:
            self.model = name
            self.serving = self.serving or name
            self.pulls = pulls
        return name

    def _rpc(self, method: str, **kwargs: Any) -> tuple[int, Any]:
        """A method of vLLM's worker through /collective_rpc: (status, the one worker's
        result, or vLLM's error text)."""
        response = self.http.post(
            f"{self.vllm}/collective_rpc", json={"method": method, "kwargs": kwargs}
        )
        if response.status_code != 200:
            return response.status_code, response.text[:300]
        try:
            return 200, response.json()["results"][0]
        except (ValueError, KeyError, IndexError, TypeError):  # vLLM answers a None result
            return 200, None  # with an empty body

    def stop(self) -> None:
        self.http.close()

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Validate (RequestError naming the field), then forward to vLLM. The client's model
        name is Dartboard's; vLLM is asked for what this adapter serves now."""
        with contextlib.suppress(ValueError):  # not yet: vLLM answers for itself below
            self.base_name()
        request = parse_chat_request(
            body,
            default_model=self.model,
            max_tokens_limit=self.max_tokens_limit,
            max_images=self.max_images,
        )
        with self.cond:
            if self.status != "ok":
                return 503, error_body(503, f"worker is {self.status}: retry on another")
            version, serving = self.version, self.serving or request.model
            self.in_flight[version] += 1
        try:
            forwarded = {
                **body,
                "model": serving,
                "logprobs": True,
                "top_logprobs": max(5, request.top_logprobs),
                # The text is what the policy wrote, special tokens (<|box_start|>) and all:
                # it is the history of the next turn, as `rollout.server` returns it.
                "skip_special_tokens": False,
                "spaces_between_special_tokens": False,
            }
            if self.never_generated:  # as `rollout.server` never samples them
                forwarded["logit_bias"] = {
                    **dict.fromkeys(map(str, self.never_generated), -100),
                    **(body.get("logit_bias") or {}),
                }
            if self.stop_ids:
                forwarded["stop_token_ids"] = sorted(
                    {*self.stop_ids, *(body.get("stop_token_ids") or [])}
                )
            # The text is made from the ids (`_texts_from_ids`) unless a client asks otherwise.
            forwarded.setdefault("return_tokens_as_token_ids", True)
            response = self.http.post(f"{self.vllm}/v1/chat/completions", json=forwarded)
            try:
                reply = response.json()
            except ValueError:
                return 502, error_body(502, f"vLLM answered {response.status_code}: not JSON")
            if response.status_code == 200:
                reply["policy_version"] = version
                reply["image_geometry"] = self.geometry.to_json()
                if self.tokenizer is not None:
                    self._texts_from_ids(reply)
            elif response.status_code == 400 and _refused_for_length(reply):
                reply["error"]["code"] = PROMPT_TOO_LONG  # as `rollout.server` says it
            return response.status_code, reply
        except httpx.HTTPError as exc:
            return 502, error_body(502, f"vLLM unreachable: {type(exc).__name__}: {exc}")
        finally:
            with self.cond:
                self.in_flight[version] -= 1
                self.cond.notify_all()

    def _texts_from_ids(self, reply: dict[str, Any]) -> None:
        """Each choice's text from its token ids (`core.replies.reply_text`), not vLLM's
        detokenizer: the same text the transformers server writes for the same ids."""
        for choice in reply.get("choices") or []:
            tokens = ((choice.get("logprobs") or {}).get("content")) or []
            try:
                ids = [int(str(t["token"]).removeprefix("token_id:")) for t in tokens]
            except (KeyError, ValueError):
                continue  # not token ids: vLLM's text stands
            if choice.get("finish_reason") == "stop" and ids and ids[-1] in self.stop_ids:
                ids = ids[:-1]
            if isinstance(choice.get("message"), dict):
                choice["message"]["content"] = reply_text(self.tokenizer, ids)

    def reload(self, checkpoint: str, version: int) -> tuple[int, dict[str, Any]]:
        """A LoRA adapter directory is loaded beside the serving one and switched to with no
        pause; full weights drain, reload in place and reset vLLM's caches."""
        with self.cond:
            if self.status != "ok":
                return 409, error_body(409, "a reload is already running")
            self.status = "switching" if is_adapter_dir(checkpoint) else "draining"
        if is_adapter_dir(checkpoint):
            return self._reloading(version, lambda: self._switch_adapter(checkpoint, version))
        return self._reloading(version, lambda: self._reload_full(checkpoint, version))

    def _reloading(
        self, version: int, work: Callable[[], tuple[int, dict[str, Any]]]
    ) -> tuple[int, dict[str, Any]]:
        """Run a reload its caller began (the status set under the lock): vLLM's errors are
        the reply, and the status is back to ok after, whatever happened."""
        try:
            return work()
        except httpx.HTTPError as exc:
            return 502, error_body(502, f"vLLM unreachable: {type(exc).__name__}: {exc}")
        except ValueError as exc:  # vLLM still starting: the router syncs again
            return 503, error_body(503, f"version {version} not loaded: {exc}")
        finally:
            with self.cond:
                self.status = "ok"

    def _switch_adapter(self, checkpoint: str, version: int) -> tuple[int, dict[str, Any]]:
        name = f"{self.base_name()}-v{version}"
        # In place: an adapter restarted while vLLM kept running finds the version it is
        # asked for already loaded under this name, and loads it again rather than failing.
        load = {"lora_name": name, "lora_path": checkpoint, "load_inplace": True}
        response = self.http.post(f"{self.vllm}/v1/load_lora_adapter", json=load)
        if response.status_code != 200:
            message = f"vLLM could not load adapter v{version}, kept v{self.version}: "
            return 502, error_body(502, message + response.text[:300])
        with self.cond:
            old_version, old = self.version, self.serving
            self.version, self.serving, self.status = version, name, "ok"
            self.adapter_dir = checkpoint
            # New requests go to the new adapter now; the old one goes once its last ends.
            self.cond.wait_for(lambda: self.in_flight[old_version] == 0)
        if old != self.model:
            self._unload(old)
        return 200, {"policy_version": version, "served_as": name}

    def _reload_full(self, checkpoint: str, version: int) -> tuple[int, dict[str, Any]]:
        self.base_name()
        with self.cond:
            self.cond.wait_for(lambda: sum(self.in_flight.values()) == 0)
            self.status = "loading"
        # vLLM's own in-place reload: checkpoint names mapped through its LoRA wrappers
        # (--enable-lora renames the base layers), LoRA, encoder and multimodal caches reset.
        status, failure = self._rpc("reload_weights", weights_path=checkpoint)
        if status != 200:
            message = f"vLLM reload failed, kept v{self.version}: {failure}"
            return 502, error_body(502, message)
        return self._full_weights_loaded(version)

    def _full_weights_loaded(self, version: int) -> tuple[int, dict[str, Any]]:
        """After vLLM loaded `version`'s full weights in place (drained): reset its caches,
        serve the base under the new version."""
        # Cached prefixes and image encodings were computed by the old weights: a request
        # reusing them would mix the two versions without any error. The encoder cache is
        # reset on the scheduler's side too: the reload emptied the worker's, and a request
        # for an image the scheduler still counts as encoded kills vLLM's engine ("Encoder
        # cache miss", seen under load on vLLM 0.32).
        for cache in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache"):
            reset = self.http.post(f"{self.vllm}{cache}")
            if reset.status_code != 200:
                message = f"weights are v{version} but {cache} failed: {reset.text[:200]}"
                return 502, error_body(502, message)
        with self.cond:
            adapter, self.version, self.serving = self.serving, version, self.model
            self.adapter_dir = None
        if adapter != self.model:  # trained on the old base: never served again
            self._unload(adapter)
        return 200, {"policy_version": version}

    def reload_pulled(self, weights: WeightSource, version: int) -> tuple[int, dict[str, Any]]:
        """Pull `version` from the trainer's weight server into vLLM (module doc): the next
        adapter while one is served, with no pause; else full weights, drained."""
        with self.cond:
            if self.status != "ok":
                return 409, error_body(409, "a reload is already running")
            adapter = self.adapter_dir
            self.status = "switching" if adapter else "draining"
        pull = {
            "weights": weights.to_json(),
            "version": version,
            "worker": self.name,
            "timeout_s": self.pull_timeout_s,
        }
        return self._reloading(version, lambda: self._pull(pull, version, adapter))

    def _pull(
        self, pull: dict[str, Any], version: int, adapter: str | None
    ) -> tuple[int, dict[str, Any]]:
        if adapter is not None:
            status, pulled = self._rpc("dartboard_pull_adapter", **pull, like=adapter)
            if status != 200 or not isinstance(pulled, dict) or "error" in pulled:
                return self._pull_failed(status, pulled)
            status, reply = self._switch_adapter(pulled["path"], version)
        else:
            self.base_name()
            with self.cond:
                self.cond.wait_for(lambda: sum(self.in_flight.values()) == 0)
                self.status = "loading"
            status, pulled = self._rpc("dartboard_pull_full", **pull)
            if status != 200 or not isinstance(pulled, dict) or "error" in pulled:
                return self._pull_failed(status, pulled)
            status, reply = self._full_weights_loaded(version)
        if status == 200:
            reply.update(source="weights", bytes=pulled["bytes"], pull_s=pulled["seconds"])
        return status, reply

    def _pull_failed(self, status: int, pulled: Any) -> tuple[int, dict[str, Any]]:
        """The reply to a pull that failed in vLLM's worker (`rollout.vllm_weights`) or
        that vLLM refused to run; vLLM's weights are as they were."""
        kept = f"weights not pulled, kept version {self.version}"
        if status != 200 or not isinstance(pulled, dict):
            return 502, error_body(502, f"{kept}: vLLM answered {status}: {pulled}")
        code = UNREACHABLE if pulled.get("unreachable") else None
        reply_status = 422 if pulled.get("mismatch") else 502
        message = f"{kept}: {pulled['error']}"
        return reply_status, error_body(reply_status, message, param="weights", code=code)

    def _unload(self, name: str) -> None:
        """Drop an adapter vLLM no longer serves; a refusal is logged (it holds one too many
        until the next switch), never fatal to the version that is now served."""
        unloaded = self.http.post(f"{self.vllm}/v1/unload_lora_adapter", json={"lora_name": name})
        if unloaded.status_code != 200:
            log.warning("vLLM did not unload adapter %s: %s", name, unloaded.text[:200])

    def models(self) -> tuple[int, dict[str, Any]]:
        try:
            response = self.http.get(f"{self.vllm}/v1/models", timeout=10)
            return response.status_code, response.json()
        except (httpx.HTTPError, ValueError) as exc:
            return 502, error_body(502, f"vLLM /v1/models: {type(exc).__name__}: {exc}")

    def health(self) -> dict[str, Any]:
        with self.cond:
            return {
                "status": self.status,
                "policy_version": self.version,
                "in_flight": sum(self.in_flight.values()),
                "queued": 0,
                "model": self.model,
                "serving": self.serving,
                "image_geometry": self.geometry.to_json(),
                "backend": "vllm",
                # What the router reads: weights may be pulled (never swapped live: drained).
                "pulls_weights": self.pulls is True,
            }


_VLLM_TOO_LONG = re.compile(r"maximum (model|context) length")
"""What vLLM's refusals of a prompt past --max-model-len say (vLLM 0.32: the renderer's
"This model's maximum context length is ...", the input processor's "The decoder prompt
(length N) is longer than the maximum model length of M"); they carry no code of their own."""


def _refused_for_length(reply: Any) -> bool:
    error = reply.get("error") if isinstance(reply, dict) else None
    return isinstance(error, dict) and bool(_VLLM_TOO_LONG.search(str(error.get("message"))))


def never_generated_tokens(tokenizer: Any) -> tuple[int, ...]:
    """The ids of `core.generation.NEVER_GENERATED` in the served model's tokenizer."""
    ids = [tokenizer.convert_tokens_to_ids(token) for token in NEVER_GENERATED]
    return tuple(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id)


def build_app(adapter: Adapter, *, tokens: ServiceTokens, source: CheckpointSource) -> TokenGate:
    async def health(_: Request) -> Response:
        return JSONReply(adapter.health())

    async def models(_: Request) -> Response:
        status, body = await run_blocking(adapter.models)
        return JSONReply(body, status)

    async def chat(http: Request) -> Response:
        body = await json_object(http)
        status, reply = await run_blocking(adapter.chat, body)
        return JSONReply(reply, status)

    async def reload(http: Request) -> Response:
        request = reload_request(await json_object(http), source)
        if request.weights is not None:
            if not adapter.pulls:  # its /health does not say pulls_weights
                message = (
                    "this vLLM was started without the weight-pull extension: checkpoints only"
                )
                return error_reply(422, message, param="weights")
            status, reply = await run_blocking(
                adapter.reload_pulled, request.weights, request.version
            )
            return JSONReply(reply, status)
        kept = f"kept version {adapter.version}"
        try:
            checkpoint = await run_blocking(local_checkpoint, request, source, kept=kept)
        except ReloadRefused as exc:
            return error_reply(exc.status, str(exc), param=exc.param)
        status, reply = await run_blocking(adapter.reload, checkpoint, request.version)
        return JSONReply(reply, status)

    endpoints = (health, models, chat, reload)
    return worker_app(endpoints, tokens=tokens, threads=(adapter.start, adapter.stop))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.vllm_adapter")
    parser.add_argument(
        "--vllm",
        required=True,
        help="`vllm serve`'s base URL (http://HOST:PORT), or unix:/PATH for its --uds socket",
    )
    parser.add_argument(
        "--policy-dir",
        required=True,
        help="the model directory vLLM serves, as this host sees it (its processor's image "
        "geometry is what clients map coordinates with)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--max-tokens-limit", type=int, default=1024)
    parser.add_argument("--max-images", type=int, default=MAX_IMAGES, help="images per prompt")
    parser.add_argument(
        "--checkpoint-root", action="append", default=[], help="else $DARTBOARD_CHECKPOINT_ROOTS"
    )
    add_registration_options(parser)
    add_store_options(parser)
    args = parser.parse_args(argv)
    tokens = service_tokens()
    source = CheckpointSource(
        checkpoint_roots(args.checkpoint_root, served=None),
        store=args.artifacts,
        cache=args.artifact_cache,
    )
    from transformers import AutoTokenizer  # deferred: seconds of import for --help

    tokenizer = AutoTokenizer.from_pretrained(args.policy_dir)
    adapter = Adapter(
        args.vllm,
        args.version,
        token=os.environ.get(VLLM_KEY_ENV) or None,
        geometry=ImageGeometry.from_policy_dir(args.policy_dir),
        max_tokens_limit=args.max_tokens_limit,
        max_images=args.max_images,
        never_generated=never_generated_tokens(tokenizer),
        stop_ids=tuple(stop_token_ids(args.policy_dir, tokenizer)),
        tokenizer=tokenizer,
        name=f"{args.host}:{args.port}",
    )
    sock = bind(args.host, args.port)
    print(f"adapting {args.vllm} on http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr)
    start_registration(args, host=args.host, port=sock.getsockname()[1], token=tokens.admin)
    serve(build_app(adapter, tokens=tokens, source=source), sock)


if __name__ == "__main__":
    main()
