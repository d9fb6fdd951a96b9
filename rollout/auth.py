"""What the rollout service's HTTP servers (inference server, router, vLLM adapter) demand of
a request: the token of the route's purpose, a sane body, and checkpoint paths under
configured roots.

Secrets by need: one master secret (DARTBOARD_SERVICE_TOKEN, generated once into
DARTBOARD_HOME/service_token) is held only by the web and the Celery workers. Every other
process gets the token of its purpose, derived from the master with HMAC-SHA256
(`purpose_token`), or set explicitly where a deployment cannot derive it (compose):

- inference (DARTBOARD_INFERENCE_TOKEN): POST /v1/chat/completions and GET /v1/models on the
  router and the inference workers; the env slots send it.
- router-admin (DARTBOARD_ADMIN_TOKEN): /admin/* on the router and POST /v1/reload on a
  worker; the trainer, the router (reloads) and a worker registering itself send it.
- vllm (VLLM_API_KEY): what vLLM demands on /v1/*, known only to vLLM and its adapter.
- desktop:<host:port> (DARTBOARD_DESKTOP_TOKEN): one desktop's (an OSWorld VM's or a
  Dartboard desktop's) own token, so a token read inside one desktop opens no other.

A token leaked from one process opens only that purpose, and no derived token gives back the
master. GET /health needs none. Tokens are compared as bytes in constant time; a header
that is not ASCII is a 401 like any other wrong token.

- A body is at most MAX_BODY_BYTES, with a valid Content-Length; sockets time out.
- A reload or sync loads weights only from a directory under one of the checkpoint roots
  (DARTBOARD_CHECKPOINT_ROOTS, os.pathsep-separated, or --checkpoint-root; by default the
  directory holding the served policy).

    .venv/bin/python -m rollout.auth inference      # a purpose's token, from the master
    .venv/bin/python -m rollout.auth desktop:10.0.0.5:5000
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MASTER_ENV = "DARTBOARD_SERVICE_TOKEN"
INFERENCE_ENV = "DARTBOARD_INFERENCE_TOKEN"
ADMIN_ENV = "DARTBOARD_ADMIN_TOKEN"
DESKTOP_ENV = "DARTBOARD_DESKTOP_TOKEN"
VLLM_KEY_ENV = "VLLM_API_KEY"  # vLLM reads it itself: the key never needs --api-key
INFERENCE, ROUTER_ADMIN, VLLM = "inference", "router-admin", "vllm"
ROOTS_ENV = "DARTBOARD_CHECKPOINT_ROOTS"
MIN_TOKEN_CHARS = 16
MAX_BODY_BYTES = 64 * 1024 * 1024  # five 1920x1080 screenshots as base64 PNG fit many times
SOCKET_TIMEOUT_S = 120.0  # a client that stops sending mid-request is dropped
UNAUTHORIZED = "missing or wrong token (send Authorization: Bearer <token>)"


class RequestRefused(Exception):
    """A request the server will not serve: `status` and an exact message."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def purpose_token(master: str, purpose: str) -> str:
    """The token of `purpose` ("inference", "router-admin", "vllm", "desktop:<host:port>"):
    HMAC-SHA256 keyed by the master, base64url without padding (43 characters). One-way: a
    purpose token says nothing of the master or of another purpose's token."""
    if len(master.strip()) < MIN_TOKEN_CHARS:
        raise ValueError(f"the master token has fewer than {MIN_TOKEN_CHARS} characters")
    digest = hmac.new(
        master.strip().encode(), f"dartboard/{purpose}".encode(), hashlib.sha256
    ).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def desktop_purpose(address: str) -> str:
    """The purpose of the desktop at `address` ("10.0.0.5:5000"), as the workers name it."""
    return f"desktop:{address.strip().lower()}"


@dataclass(frozen=True)
class ServiceTokens:
    """The tokens a rollout server accepts: `inference` on the inference routes, `admin` on
    the administration routes (/admin/* and POST /v1/reload). Never equal: one would open
    the other's routes."""

    inference: str
    admin: str

    def __post_init__(self) -> None:
        for name, value in (("inference", self.inference), ("admin", self.admin)):
            if len(value.strip()) < MIN_TOKEN_CHARS or not value.isascii():
                raise ValueError(
                    f"the {name} token must be ASCII, at least {MIN_TOKEN_CHARS} characters"
                )
        if hmac.compare_digest(self.inference.encode(), self.admin.encode()):
            raise ValueError("the inference and admin tokens are the same: derive each")

    @classmethod
    def derived(cls, master: str) -> ServiceTokens:
        return cls(purpose_token(master, INFERENCE), purpose_token(master, ROUTER_ADMIN))

    @classmethod
    def fresh(cls) -> ServiceTokens:
        """A random pair, for a server whose only client is the process that starts it."""
        return cls(secrets.token_urlsafe(32), secrets.token_urlsafe(32))

    def for_path(self, path: str) -> str:
        return self.admin if is_admin_path(path) else self.inference

    def environ(self) -> dict[str, str]:
        """The variables a rollout server reads them from (`service_tokens`)."""
        return {INFERENCE_ENV: self.inference, ADMIN_ENV: self.admin}


def is_admin_path(path: str) -> bool:
    return path.startswith("/admin/") or path == "/admin" or path == "/v1/reload"


def service_tokens() -> ServiceTokens:
    """A server's tokens, from DARTBOARD_INFERENCE_TOKEN and DARTBOARD_ADMIN_TOKEN; raises
    SystemExit with the fix when one is missing (a server never reads the master)."""
    missing = [
        name
        for name in (INFERENCE_ENV, ADMIN_ENV)
        if len(os.environ.get(name, "").strip()) < MIN_TOKEN_CHARS
    ]
    if missing:
        raise SystemExit(
            f"no service token: set {' and '.join(missing)} (at least {MIN_TOKEN_CHARS} "
            "characters each; `make run` passes them; `python -m rollout.auth inference` and "
            "`python -m rollout.auth router-admin` print them from DARTBOARD_SERVICE_TOKEN)"
        )
    try:
        return ServiceTokens(os.environ[INFERENCE_ENV].strip(), os.environ[ADMIN_ENV].strip())
    except ValueError as exc:
        raise SystemExit(f"bad service tokens: {exc}") from None


def client_token(token: str | None, env: str = INFERENCE_ENV) -> str | None:
    """A client's token: the one given, else the purpose's variable (`env`)."""
    return token or os.environ.get(env) or None


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_token(authorization: str | bytes | None, token: str) -> None:
    """Raise RequestRefused(401) unless the header carries `token`. Compared as bytes: a
    header with characters outside ASCII is a wrong token, never an error (comparing `str`s
    with hmac.compare_digest raises TypeError on them)."""
    if isinstance(authorization, str):
        authorization = authorization.encode()
    scheme, _, given = (authorization or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), token.encode()):
        raise RequestRefused(401, UNAUTHORIZED)


def content_length(value: str | None) -> int:
    """The body length a request declares, checked against MAX_BODY_BYTES."""
    if value is None or value == "":
        return 0
    try:
        length = int(value)
    except ValueError:
        raise RequestRefused(400, f"Content-Length {value!r} is not an integer") from None
    if length < 0:
        raise RequestRefused(400, f"Content-Length {length} is negative")
    if length > MAX_BODY_BYTES:
        raise RequestRefused(413, f"body of {length} bytes; at most {MAX_BODY_BYTES}")
    return length


def checkpoint_roots(extra: list[str], *, served: str | None) -> list[Path]:
    """The roots a reload may load from: --checkpoint-root values and ROOTS_ENV, else the
    directory holding the served policy."""
    roots = [*extra, *[r for r in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if r]]
    if not roots and served:
        roots = [str(Path(served).resolve().parent)]
    return [Path(r).resolve() for r in roots]


def checkpoint_allowed(path: str, roots: list[Path]) -> Path:
    """The resolved checkpoint directory when it lies under a root; RequestRefused(403)
    otherwise (symlinks resolved first, so a link cannot lead out of a root)."""
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots) or "(none configured)"
        raise RequestRefused(
            403,
            f"checkpoint {path} is outside the checkpoint roots ({allowed})",
            param="checkpoint",
        )
    return resolved


# Variables a rollout service process (inference server, router, vLLM adapter, vLLM) inherits:
# how to run, where models and caches are, never a secret. Everything else it is given by name.
INHERITED = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "OMP_NUM_THREADS",
        "OMP_WAIT_POLICY",
        "MKL_NUM_THREADS",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_HOME",
        ROOTS_ENV,
    }
)
# Where an s3:// artifact store is, for a service that fetches versions from it.
S3_PLACE = ("AWS_S3_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CA_BUNDLE")
# A read-only key pair for the services (they only fetch); without it they get the store's
# own keys, which can also write and delete.
READ_KEY_ENV = "DARTBOARD_ARTIFACTS_READ_KEY_ID"
READ_SECRET_ENV = "DARTBOARD_ARTIFACTS_READ_SECRET_KEY"


def service_environ(base: Mapping[str, str], *, store: str | None = None) -> dict[str, str]:
    """The part of `base` (the starting process's environment) a rollout service may see:
    INHERITED and LC_*; with an s3:// `store` it fetches from, S3's address and a key pair
    (READ_KEY_ENV / READ_SECRET_ENV as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY where set,
    else the store's own). Never SECRET_KEY, DATABASE_URL, REDIS_URL, the master token or
    another purpose's token: the caller adds the service's own tokens."""
    env = {k: v for k, v in base.items() if k in INHERITED or k.startswith("LC_")}
    if store and store.startswith("s3://"):
        env.update({k: base[k] for k in S3_PLACE if k in base})
        if base.get(READ_KEY_ENV) and base.get(READ_SECRET_ENV):
            env["AWS_ACCESS_KEY_ID"] = base[READ_KEY_ENV]
            env["AWS_SECRET_ACCESS_KEY"] = base[READ_SECRET_ENV]
        else:
            keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
            env.update({k: base[k] for k in keys if k in base})
    return env


def main(argv: list[str] | None = None) -> None:
    """Print a purpose's token, derived from DARTBOARD_SERVICE_TOKEN (else the one generated
    into DARTBOARD_HOME/service_token), for a server started by hand or an OSWorld VM."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit(
            "usage: python -m rollout.auth PURPOSE  (inference, router-admin, vllm or "
            "desktop:HOST:PORT)"
        )
    master = os.environ.get(MASTER_ENV, "").strip()
    if not master:
        home = Path(os.environ.get("DARTBOARD_HOME", "var")).expanduser()
        stored = home / "service_token"
        master = stored.read_text().strip() if stored.exists() else ""
    if not master:
        raise SystemExit(f"no master token: set {MASTER_ENV} (or DARTBOARD_HOME)")
    print(purpose_token(master, args[0]))


if __name__ == "__main__":
    main()
