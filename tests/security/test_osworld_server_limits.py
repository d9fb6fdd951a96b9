"""The OSWorld-protocol desktop server's limits against a client without the token or with
too many connections: a 401 comes from the headers alone (a declared 70 MB body is never
waited for), at most MAX_CONNECTIONS handler threads exist (one more connection is answered
503 at once), a non-ASCII Authorization header is a 401, and a command whose output passed
the sandbox's cap says so in /execute's answer.

The limit tests serve the real OSWorldHTTPServer in this process, on 127.0.0.1, over a
desktop that is never started: nothing they send reaches a route that touches it (a 401, a
503, GET /platform), and its handler threads can be counted here. The output test drives
the session's real sandboxed desktop (tests/osworld_desktop.py).
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Iterator
from http.client import HTTPResponse

import pytest
import requests

from envmanager.osworld_desktop import OSWorldDesktop
from envmanager.osworld_server import (
    MAX_CONNECTIONS,
    OUTPUT_CUT,
    OSWorldHTTPServer,
    token_matches,
)

TOKEN = "limits-token-3f9a"
WAIT_S = 30  # a failure detector only: the old server waited 120 s for the body it read


@pytest.fixture
def server() -> Iterator[OSWorldHTTPServer]:
    desktop = OSWorldDesktop()  # never started (see the module docstring)
    httpd = OSWorldHTTPServer(("127.0.0.1", 0), desktop=desktop, token=TOKEN)
    serving = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    serving.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        serving.join()
        desktop.close()


def _connect(httpd: OSWorldHTTPServer) -> socket.socket:
    host, port = httpd.server_address[:2]
    return socket.create_connection((str(host), int(port)), timeout=WAIT_S)


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    response = HTTPResponse(sock)
    response.begin()
    return response.status, dict(response.getheaders()), response.read()


def _handler_threads() -> set[threading.Thread]:
    """The server's per-connection threads (socketserver names them by their target)."""
    return {t for t in threading.enumerate() if t.name.endswith("(process_request_thread)")}


PLATFORM = b"GET /platform HTTP/1.1\r\nHost: desktop\r\nAuthorization: Bearer %s\r\n\r\n"


@pytest.mark.parametrize(
    "authorization",
    [b"", b"Authorization: Bearer not-the-token\r\n", b"Authorization: Basic \xc3\xa9\xff\r\n"],
    ids=["none", "wrong", "non-ascii"],
)
def test_a_401_comes_from_the_headers_and_the_declared_body_is_never_read(server, authorization):
    with _connect(server) as sock:
        sock.sendall(
            b"POST /setup/upload HTTP/1.1\r\nHost: desktop\r\n" + authorization + b"Content-Type:"
            b" multipart/form-data; boundary=x\r\nContent-Length: 70000000\r\n\r\n"
        )  # and not one byte of the 70 MB: the answer cannot wait for them
        status, headers, _ = _answer(sock)
        assert status == 401
        assert headers["Connection"] == "close"
        assert sock.recv(1) == b""  # closed: the unread body can never be taken for a request


def test_a_non_ascii_authorization_header_is_a_401_not_a_500(server):
    for header in (
        b"Bearer \xc3\xa9t\xc3\xa9",
        b"Bearer \xff\xfe",
        b"Basic " + b"\xe2\x82\xac" * 8,
        b"\xc3\xa9 " + TOKEN.encode(),
    ):
        with _connect(server) as sock:
            sock.sendall(
                b"GET /platform HTTP/1.1\r\nHost: d\r\nAuthorization: " + header + b"\r\n\r\n"
            )
            assert _answer(sock)[0] == 401, header
    # Compared as the bytes that came on the wire (http.server decodes them as latin-1).
    wire = "Bearer " + "tökén".encode().decode("latin-1")
    assert token_matches(wire, "tökén") and not token_matches(wire, "token")
    assert not token_matches("Bearer tökén\udcff", TOKEN)  # not from the parser: no bytes


def test_connections_past_the_bound_get_503_and_start_no_thread(server):
    before, handlers = _handler_threads(), set()
    extra = 3
    socks = [_connect(server) for _ in range(MAX_CONNECTIONS + extra)]  # all idle
    try:
        # The refused ones are answered at once; the served ones wait for a request line.
        answered: list[socket.socket] = []
        while len(answered) < extra:
            ready, _, _ = select.select([s for s in socks if s not in answered], [], [], WAIT_S)
            assert ready, f"only {len(answered)} connections were answered 503"
            answered += ready
        assert len(answered) == extra
        for sock in answered:
            status, headers, body = _answer(sock)
            assert status == 503 and headers["Connection"] == "close"
            assert "busy" in json.loads(body)["message"]
        handlers = _handler_threads() - before
        assert len(handlers) == MAX_CONNECTIONS
        served = [s for s in socks if s not in answered]
        served[0].sendall(PLATFORM % TOKEN.encode())
        assert _answer(served[0])[0] == 200
    finally:
        for sock in socks:
            sock.close()
    for thread in handlers:
        thread.join(WAIT_S)  # each ends on its client's close and gives its slot back
    assert not _handler_threads() - before
    with _connect(server) as sock:
        sock.sendall(PLATFORM % TOKEN.encode())
        assert _answer(sock)[0] == 200


@pytest.mark.slow  # waits out IDLE_S (10 s)
def test_an_idle_connection_is_closed_and_its_slot_freed(server):
    """A client that connects and says nothing holds a slot for IDLE_S seconds, not minutes:
    16 such sockets would otherwise keep the desktop from its agent."""
    before = _handler_threads()
    with _connect(server) as sock:
        assert sock.recv(1) == b""  # closed by the server (the client gives up after WAIT_S)
    for thread in _handler_threads() - before:
        thread.join(WAIT_S)
    assert not _handler_threads() - before


@pytest.mark.desktop
def test_execute_says_when_the_sandbox_cut_the_output(osworld_desktop):
    url = f"http://{osworld_desktop.address}"
    auth = ("dartboard", osworld_desktop.token)
    answer = requests.post(f"{url}/execute", json={"command": ["yes"]}, auth=auth, timeout=120)
    assert answer.status_code == 200
    body = answer.json()
    assert body["truncated"] is True and body["error"].endswith(OUTPUT_CUT + "\n")
    assert body["returncode"] != 0 and 0 < len(body["output"]) <= 4 * 1024 * 1024
    script = requests.post(
        f"{url}/run_bash_script", json={"script": "yes"}, auth=auth, timeout=120
    ).json()
    assert script["truncated"] is True and script["output"].endswith(OUTPUT_CUT + "\n")
    plain = requests.post(f"{url}/execute", json={"command": ["echo", "hi"]}, auth=auth).json()
    assert plain == {"status": "success", "output": "hi\n", "error": "", "returncode": 0}
