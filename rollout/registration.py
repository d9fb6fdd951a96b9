"""An inference worker that registers itself with the router (`--register ROUTER_URL`), so a
deployment adds inference capacity by starting workers, not by reconfiguring the router.

The worker posts its own URL (`--advertise`, else http://<hostname>:<port>) to the router's
`POST /admin/workers` with the admin token when it starts, retrying until the router
answers, and again every `every_s` seconds: registration is idempotent, and a router that
restarted (it keeps its workers in memory) learns them back within that period.
"""

from __future__ import annotations

import argparse
import logging
import socket
import threading

import httpx

from rollout.auth import bearer

log = logging.getLogger("rollout.registration")


def add_registration_options(parser: argparse.ArgumentParser) -> None:
    """--register, --register-every, --advertise (the transformers server and the vLLM
    adapter take the same)."""
    parser.add_argument(
        "--register",
        default=None,
        metavar="ROUTER_URL",
        help="register this worker with the router at start and every --register-every s",
    )
    parser.add_argument("--register-every", type=float, default=30.0)
    parser.add_argument(
        "--advertise", default=None, help="this worker's URL for the router (else host:port)"
    )


def start_registration(args: argparse.Namespace, *, host: str, port: int, token: str) -> None:
    """With --register, keep this worker registered with the router (a daemon thread)."""
    if args.register:
        own = advertised_url(host, port, args.advertise)
        Registration(args.register, own, token=token, every_s=args.register_every).start()


def advertised_url(host: str, port: int, advertise: str | None) -> str:
    """The URL the router should use for this worker: --advertise, else this host's name
    when listening on every interface, else the address it listens on."""
    if advertise:
        return advertise.rstrip("/")
    name = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://{name}:{port}"


class Registration(threading.Thread):
    def __init__(self, router: str, own_url: str, *, token: str | None, every_s: float = 30.0):
        super().__init__(daemon=True, name="router-registration")
        self.router = router.rstrip("/")
        self.own_url = own_url
        self.headers = bearer(token)
        self.every_s = every_s
        self.stop_event = threading.Event()
        self.registered = threading.Event()  # set after the first success

    def register_once(self) -> bool:
        try:
            response = httpx.post(
                f"{self.router}/admin/workers",
                json={"url": self.own_url},
                headers=self.headers,
                timeout=10,
            )
        except httpx.HTTPError as exc:
            log.warning("router %s unreachable (%s); registering again later", self.router, exc)
            return False
        if response.status_code >= 400:
            log.error(
                "router %s refused registration of %s: %s %s",
                self.router,
                self.own_url,
                response.status_code,
                response.text[:300],
            )
            return False
        if not self.registered.is_set():
            log.info("registered %s with the router %s", self.own_url, self.router)
        self.registered.set()
        return True

    def run(self) -> None:
        delay = 1.0
        while not self.stop_event.is_set():
            ok = self.register_once()
            # Until the first success, retry soon (the router may still be starting).
            wait = self.every_s if ok else min(delay, self.every_s)
            delay = 1.0 if ok else min(delay * 2, self.every_s)
            self.stop_event.wait(wait)

    def stop(self) -> None:
        self.stop_event.set()
