"""Put a `vllm serve` process behind Dartboard's inference-worker contract.

    VLLM_SERVER_DEV_MODE=1 vllm serve /models/policy --port 8200 --max-logprobs 20 \\
        --worker-extension-cls rollout.vllm_ext.ReloadFromDisk
    python -m rollout.vllm_adapter --vllm http://127.0.0.1:8200 --port 8101 --version 0

The adapter answers like `rollout.server`, so the router and the env slots cannot tell the
difference: POST /v1/chat/completions is passed through (asking vLLM for per-token
logprobs and top-5 alternatives, from which the client estimates the entropy) and the reply
gains `policy_version`; POST /v1/reload {"checkpoint", "version"} drains, calls the worker
extension through vLLM's /collective_rpc, then serves the new version; GET /health reports
status, version and in-flight requests. Every route but /health needs the service token
and a reload loads only from the checkpoint roots (`rollout.auth`); keep vLLM itself (and its
dev-mode /collective_rpc) reachable only from this adapter. CUDA-only: exercised on GPU
hosts, not in CI.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from rollout.auth import (
    SOCKET_TIMEOUT_S,
    RequestRefused,
    check_token,
    checkpoint_allowed,
    checkpoint_roots,
    content_length,
    service_token,
)


class Adapter:
    def __init__(self, vllm_url: str, version: int) -> None:
        self.vllm = vllm_url.rstrip("/")
        self.version = version
        self.status = "ok"
        self.in_flight = 0
        self.cond = threading.Condition()
        self.http = httpx.Client(timeout=600)

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.cond:
            if self.status != "ok":
                return 503, {"error": {"message": f"worker is {self.status}"}}
            self.in_flight += 1
            version = self.version
        try:
            body = {**body, "logprobs": True, "top_logprobs": max(5, body.get("top_logprobs", 0))}
            body.setdefault("return_tokens_as_token_ids", True)
            response = self.http.post(f"{self.vllm}/v1/chat/completions", json=body)
            reply = response.json()
            if response.status_code == 200:
                reply["policy_version"] = version
            return response.status_code, reply
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()

    def reload(self, checkpoint: str, version: int) -> tuple[int, dict[str, Any]]:
        with self.cond:
            if self.status != "ok":
                return 409, {"error": {"message": "a reload is already running"}}
            self.status = "draining"
            self.cond.wait_for(lambda: self.in_flight == 0)
            self.status = "loading"
        try:
            response = self.http.post(
                f"{self.vllm}/collective_rpc",
                json={"method": "reload_from_disk", "args": [checkpoint]},
            )
            if response.status_code != 200:
                return 502, {"error": {"message": f"vLLM reload failed: {response.text[:300]}"}}
            with self.cond:
                self.version = version
            return 200, {"policy_version": version}
        finally:
            with self.cond:
                self.status = "ok"

    def health(self) -> dict[str, Any]:
        with self.cond:
            return {
                "status": self.status,
                "policy_version": self.version,
                "in_flight": self.in_flight,
                "queued": 0,
                "backend": "vllm",
            }


def make_handler(
    adapter: Adapter, *, token: str, roots: list[Path]
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body are two writes
        timeout = SOCKET_TIMEOUT_S

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, adapter.health())
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            try:
                check_token(self.headers.get("Authorization"), token)
                length = content_length(self.headers.get("Content-Length"))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not isinstance(body, dict):
                    raise RequestRefused(400, "request body must be a JSON object")
                if self.path == "/v1/chat/completions":
                    self._send(*adapter.chat(body))
                elif self.path == "/v1/reload":
                    checkpoint, version = body.get("checkpoint"), body.get("version")
                    if not isinstance(checkpoint, str) or not isinstance(version, int):
                        raise RequestRefused(400, "reload needs checkpoint (str), version (int)")
                    checkpoint_allowed(checkpoint, roots)
                    self._send(*adapter.reload(checkpoint, version))
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
            except json.JSONDecodeError as exc:
                self._send(400, {"error": {"message": f"invalid JSON: {exc}"}})
            except RequestRefused as exc:
                self.close_connection = True
                self._send(exc.status, {"error": {"message": str(exc), "param": exc.param}})

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m rollout.vllm_adapter")
    parser.add_argument("--vllm", required=True, help="base URL of `vllm serve`")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8101)
    parser.add_argument("--version", type=int, default=0)
    parser.add_argument("--token-file", default=None, help="else $DARTBOARD_SERVICE_TOKEN")
    parser.add_argument(
        "--checkpoint-root", action="append", default=[], help="else $DARTBOARD_CHECKPOINT_ROOTS"
    )
    args = parser.parse_args()
    token = service_token(args.token_file)
    roots = checkpoint_roots(args.checkpoint_root, served=None)
    adapter = Adapter(args.vllm, args.version)
    handler = make_handler(adapter, token=token, roots=roots)
    ThreadingHTTPServer((args.host, args.port), handler).serve_forever()


if __name__ == "__main__":
    main()
