"""Put a `vllm serve` process behind Dartboard's inference-worker contract.

    VLLM_SERVER_DEV_MODE=1 vllm serve /models/policy --port 8200 --max-logprobs 20 \\
        --api-key "$DARTBOARD_SERVICE_TOKEN" --worker-extension-cls rollout.vllm_ext.ReloadFromDisk
    python -m rollout.vllm_adapter --vllm http://127.0.0.1:8200 --port 8101 --version 0

The adapter answers like `rollout.server`, so the router and the env slots cannot tell the
difference: POST /v1/chat/completions is checked field by field as `rollout.server` checks it
(`parse_chat_request`: a bad field is a 400 naming it, before vLLM sees anything), then passed
through asking vLLM for per-token logprobs and top-5 alternatives (from which the client
estimates the entropy), and the reply gains `policy_version`; POST /v1/reload {"checkpoint",
"version"} drains, calls the worker extension through vLLM's /collective_rpc, then serves the
new version; GET /v1/models is vLLM's list; GET /health reports status, version, model and
in-flight requests.

Starlette on uvicorn (`rollout.asgi`): every route but /health needs the service token and a
reload loads only from the checkpoint roots (`rollout.auth`); keep vLLM itself (and its
dev-mode /collective_rpc) reachable only from this adapter. vLLM itself is CUDA-only; the
adapter's own checks are tested in CI with `rollout.server` standing in as the OpenAI backend.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rollout.asgi import (
    JSONReply,
    TokenGate,
    bind,
    error_body,
    json_object,
    run_blocking,
    serve,
    service_app,
    threads_lifespan,
)
from rollout.auth import bearer, checkpoint_roots, service_token
from rollout.server import parse_chat_request, reload_fields


class Adapter:
    """Status, version and in-flight count of one vLLM server; `cond` guards them."""

    def __init__(
        self, vllm_url: str, version: int, *, token: str, max_tokens_limit: int = 1024
    ) -> None:
        """`token` is sent to vLLM too: start it with `--api-key` set to the service token."""
        self.vllm = vllm_url.rstrip("/")
        self.version = version
        self.max_tokens_limit = max_tokens_limit
        self.model = ""
        self.status = "ok"
        self.in_flight = 0
        self.cond = threading.Condition()
        self.http = httpx.Client(timeout=600, headers=bearer(token))

    def start(self) -> None:
        """Learn the served model's name (the requests' default)."""
        try:
            listed = self.http.get(f"{self.vllm}/v1/models", timeout=10).json()
            self.model = listed["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            print(f"vLLM at {self.vllm} lists no model yet: {exc}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self.http.close()

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Validate (RequestError naming the field), then forward to vLLM."""
        request = parse_chat_request(
            body, default_model=self.model, max_tokens_limit=self.max_tokens_limit
        )
        with self.cond:
            if self.status != "ok":
                return 503, error_body(503, f"worker is {self.status}: retry on another")
            self.in_flight += 1
            version = self.version
        try:
            body = {
                **body,
                "model": request.model,
                "logprobs": True,
                "top_logprobs": max(5, request.top_logprobs),
            }
            body.setdefault("return_tokens_as_token_ids", True)
            response = self.http.post(f"{self.vllm}/v1/chat/completions", json=body)
            try:
                reply = response.json()
            except ValueError:
                reply = error_body(502, f"vLLM answered {response.status_code}: not JSON")
                return 502, reply
            if response.status_code == 200:
                reply["policy_version"] = version
            return response.status_code, reply
        except httpx.HTTPError as exc:
            return 502, error_body(502, f"vLLM unreachable: {type(exc).__name__}: {exc}")
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()

    def reload(self, checkpoint: str, version: int) -> tuple[int, dict[str, Any]]:
        with self.cond:
            if self.status != "ok":
                return 409, error_body(409, "a reload is already running")
            self.status = "draining"
            self.cond.wait_for(lambda: self.in_flight == 0)
            self.status = "loading"
        try:
            response = self.http.post(
                f"{self.vllm}/collective_rpc",
                json={"method": "reload_from_disk", "args": [checkpoint]},
            )
            if response.status_code != 200:
                message = f"vLLM reload failed, kept v{self.version}: {response.text[:300]}"
                return 502, error_body(502, message)
            with self.cond:
                self.version = version
            return 200, {"policy_version": version}
        except httpx.HTTPError as exc:
            return 502, error_body(502, f"vLLM unreachable: {type(exc).__name__}: {exc}")
        finally:
            with self.cond:
                self.status = "ok"

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
                "in_flight": self.in_flight,
                "queued": 0,
                "model": self.model,
                "backend": "vllm",
            }


def build_app(adapter: Adapter, *, token: str, roots: list[Path]) -> TokenGate:
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
        checkpoint, version = reload_fields(await json_object(http), roots)
        status, reply = await run_blocking(adapter.reload, checkpoint, version)
        return JSONReply(reply, status)

    return service_app(
        [
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/reload", reload, methods=["POST"]),
        ],
        token=token,
        lifespan=threads_lifespan(adapter.start, adapter.stop),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.vllm_adapter")
    parser.add_argument("--vllm", required=True, help="base URL of `vllm serve`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--max-tokens-limit", type=int, default=1024)
    parser.add_argument("--token-file", default=None, help="else $DARTBOARD_SERVICE_TOKEN")
    parser.add_argument(
        "--checkpoint-root", action="append", default=[], help="else $DARTBOARD_CHECKPOINT_ROOTS"
    )
    args = parser.parse_args(argv)
    token = service_token(args.token_file)
    roots = checkpoint_roots(args.checkpoint_root, served=None)
    adapter = Adapter(args.vllm, args.version, token=token, max_tokens_limit=args.max_tokens_limit)
    sock = bind(args.host, args.port)
    print(f"adapting {args.vllm} on http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr)
    serve(build_app(adapter, token=token, roots=roots), sock)


if __name__ == "__main__":
    main()
