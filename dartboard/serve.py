"""The web server: uvicorn serving `dartboard.asgi:application` (HTTP and Channels' WebSockets).

Run: `python -m dartboard.serve --host 127.0.0.1 --port 8000`. The launcher (`make run`),
docker-compose, the Dockerfile and the tests all start the web with this module, so every
one of them serves with the options below.

Why uvicorn and not daphne: a request body must meet its limit while it arrives
(`dartboard/body_limit.py`), and only a server that hands the body to the application as it
reads it lets the application refuse it. Daphne (on twisted's `http.Request`) writes the
whole body into a temporary file (in memory below 100 kB) and calls the application only once
the last byte is in, so a 1 GiB upload costs 1 GiB of disk before any limit sees it, and an
ASGI middleware cannot change that. Uvicorn starts the application when the headers are in
and passes the body on in `http.request` messages as the client sends it, reading no further
than 64 kB ahead of the application (it pauses the socket), so `BodyLimit` answers 413 on a
declared Content-Length before any byte is read, and on a chunked body as soon as its count
passes the limit, and the connection is closed.

Options, each for a reason:
- `http="h11"`, `ws="wsproto"`: the pure-Python protocols the lock installs (wsproto gives
  Channels' consumers their WebSockets); named so that no optional package changes them.
- `lifespan="off"`: Channels' `ProtocolTypeRouter` has no lifespan handler.
- `proxy_headers=False`: the client address is the peer's; Django reads X-Forwarded-For
  itself, and only behind DARTBOARD_TLS_PROXY (`dartboard/settings.py`).
- `timeout_graceful_shutdown`: a SIGTERM ends open requests and WebSockets within it, so the
  launcher's stop is not held by a slow upload.
"""

from __future__ import annotations

import argparse

import uvicorn

APPLICATION = "dartboard.asgi:application"
GRACEFUL_SHUTDOWN_S = 5


def web_serve(*, host: str, port: int) -> None:
    """Serve the dashboard on host:port until SIGTERM or SIGINT."""
    uvicorn.run(
        APPLICATION,
        host=host,
        port=port,
        http="h11",
        ws="wsproto",
        lifespan="off",
        proxy_headers=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    web_serve(host=args.host, port=args.port)


if __name__ == "__main__":
    main()
