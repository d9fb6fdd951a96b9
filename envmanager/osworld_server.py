"""OSWorld's in-VM HTTP protocol, served by a Dartboard desktop (envmanager.osworld_desktop).

OSWorld's client (`PythonController`, `SetupController` and the getters of the desktop-env
wheel) drives a VM through a Flask server inside it; that server is not in the wheel. This
one answers the same routes with the same status codes and JSON shapes, so the wheel's own
client, unchanged, drives a sandboxed Dartboard desktop:

    GET  /screenshot            PNG bytes (image/png); no cursor drawn into it
    POST /screen_size           {"width", "height"}
    POST /execute, /setup/execute   {"command": [...] | "...", "shell"} ->
                                {"status", "output", "error", "returncode"}; 500 {"status":
                                "error", "message"} when it cannot run or times out
    POST /run_python            {"code"} -> {"status", "message", "need_more", "output",
                                "error", "return_code"}
    POST /run_bash_script       {"script", "timeout", "working_dir"} -> {"status", "output",
                                "error": "", "returncode"} (stderr merged into output)
    POST /setup/launch          {"command", "shell"} -> "<command> launched successfully"
    POST /file                  form file_path -> the bytes; 404 {"error": "File not found"}
    POST /setup/upload          multipart file_path + file_data -> "File Uploaded: N bytes"
    POST /list_directory        {"path"} -> {"directory_tree": {...}}
    POST /setup/open_file       {"path"} -> 200 once its window shows
    POST /setup/activate_window, /setup/close_window   {"window_name", "strict", "by_class"}
    POST /window_size           form app_class_name -> {"width", "height"}
    POST /desktop_path          {"desktop_path": "/home/user/Desktop"}
    GET  /terminal              {"output": null, "status": "success"}: what OSWorld's server
                                answers when no gnome-terminal is focused (no AT-SPI here)
    GET  /platform              Linux
    POST /dartboard/reset       Dartboard's own: stop the apps, empty the home (a VM's
                                snapshot revert, for a desktop that has none)
    GET  /dartboard/offers      Dartboard's own: {"offers": ["app:libreoffice", ...]}, what
                                the desktop offers tasks (envmanager.osworld_needs)

Not here, each a 501 with the reason: /accessibility (no AT-SPI bus), /wallpaper and
/setup/change_wallpaper (openbox draws none), /setup/download_file (the desktop has no
network), /start_recording and /end_recording (no ffmpeg), /setup/execute_with_verification.

Everything a request runs (/execute, /run_python, /run_bash_script, /setup/execute,
/setup/launch, /setup/open_file) runs in the desktop's bubblewrap sandbox: its own uid, no
network, a clean environment (DISPLAY, HOME, PATH, LANG, PYTHONPATH), nothing of this
server's environment. /file, /setup/upload and /list_directory reach only /home/user (403
for a path outside it) and read or write as the sandboxed agent.

Every route needs this desktop's own token (DARTBOARD_DESKTOP_TOKEN: the workers derive
one per desktop address, so a token read inside one desktop opens no other): OSWorld's client builds `http://{vm_ip}:{port}` and
sends no header of its own, so it is given `vm_ip="dartboard:<token>@127.0.0.1"` and
`requests` sends the URL's userinfo as HTTP Basic auth (password = token; `<token>@host`
alone sends nothing: requests takes userinfo only with a password part).
`Authorization: Bearer <token>` works too. Anything else is a 401, answered from the headers
alone: the body an unauthenticated client declares is never read (the connection is closed
instead), so a stranger cannot make the server read 70 MiB. Bodies are capped at 70 MiB.

At most MAX_CONNECTIONS connections are served at once, each on its own thread; one more is
answered 503 by the accepting thread and closed at once, so idle or slow connections cannot
grow the server's threads without bound (OSWorld's client opens one connection a request).

    DARTBOARD_DESKTOP_TOKEN=$(python -m rollout.auth desktop:HOST:PORT) \\
        .venv/bin/python -m envmanager.osworld_server --port 5000
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import email.parser
import email.policy
import hmac
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

from envmanager.osworld_desktop import (
    VM_HOME,
    CommandResult,
    DesktopFileError,
    OSWorldDesktop,
    PathRefused,
    vm_path,
)

log = logging.getLogger("dartboard.osworld_server")

MAX_BODY_BYTES = 70 * 1024 * 1024  # a 64 MiB upload plus its multipart envelope
# OSWorld's client sends one request at a time per desktop; 16 leaves room for a person's
# probe or two while bounding what idle connections can cost (a thread and IDLE_S each).
MAX_CONNECTIONS = 16
# How long a connection may stay silent: before its request, between requests, or between
# two reads of its body (a 70 MiB upload sends far faster than that). Past it the connection
# is closed and its slot freed, so 16 idle sockets hold the server for seconds, not minutes.
IDLE_S = 10
_BUSY = json.dumps(
    {
        "status": "error",
        "message": f"the desktop server is busy: it serves at most {MAX_CONNECTIONS} "
        "connections at once; retry",
    }
).encode()
BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY)
)
# What /execute, /run_python and /run_bash_script add (to "error", or to "output" where
# stderr is merged into it) when the sandbox cut a command's output, with "truncated": true
# (a key OSWorld's server does not send: it appears only then, so the usual answer keeps
# OSWorld's exact shape).
OUTPUT_CUT = (
    "[dartboard: the command's output passed the sandbox's cap: it was cut there and the "
    "command was killed]"
)
NOT_HERE = {
    "/accessibility": "no accessibility tree on a Dartboard desktop (no AT-SPI bus)",
    "/wallpaper": "a Dartboard desktop has no wallpaper (openbox draws none)",
    "/setup/change_wallpaper": "a Dartboard desktop has no wallpaper (openbox draws none)",
    "/setup/download_file": "a Dartboard desktop has no network: upload the file instead",
    "/start_recording": "screen recording is not available on a Dartboard desktop",
    "/end_recording": "screen recording is not available on a Dartboard desktop",
    "/setup/execute_with_verification": "not implemented on a Dartboard desktop",
}


class Refused(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def token_matches(header: str | None, token: str) -> bool:
    """Basic auth whose user (or password) is the token, or a Bearer token.

    Compared as bytes, never as text: http.server decodes header lines as latin-1, so
    `header.encode("latin-1")` is what came on the wire, and any byte a client sends (a
    non-ASCII Authorization header) is a mismatch, never an exception."""
    if not header:
        return False
    want = token.encode("utf-8", "surrogateescape")  # how os.environ keeps undecodable bytes
    try:
        raw = header.encode("latin-1")
    except UnicodeEncodeError:  # not from http.server's parser: no byte string it came from
        return False
    scheme, _, value = raw.partition(b" ")
    if scheme.lower() == b"bearer":
        return hmac.compare_digest(value.strip(), want)
    if scheme.lower() == b"basic":
        try:
            user, _, password = base64.b64decode(value.strip(), validate=True).partition(b":")
        except ValueError:  # binascii.Error: not base64
            return False
        return hmac.compare_digest(user, want) | hmac.compare_digest(password, want)
    return False


class Handler(BaseHTTPRequestHandler):
    server: OSWorldHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = IDLE_S  # socket timeout: a silent connection is closed (see IDLE_S)

    # ------------------------------------------------------------------ plumbing

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the stdlib's name)
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        try:
            if not token_matches(self.headers.get("Authorization"), self.server.token):
                # Decided on the headers alone: the declared body is never read (a stranger
                # could declare 70 MiB), and the unread body makes the connection unusable.
                self.close_connection = True
                raise Refused(401, {"error": "a valid service token is required"})
            route = ROUTES.get((method, self.path.split("?")[0]))
            if route is None:
                self._body()
                if self.path in NOT_HERE:
                    raise Refused(501, {"status": "error", "message": NOT_HERE[self.path]})
                raise Refused(404, {"error": f"no route {method} {self.path}"})
            status, body, content_type = route(self)
        except Refused as exc:
            status, body, content_type = exc.status, exc.body, None
        except PathRefused as exc:
            status, body, content_type = 403, {"error": str(exc)}, None
        except DesktopFileError as exc:
            status, body, content_type = exc.status, {"error": str(exc)}, None
        except Exception as exc:  # the answer says what failed; the server goes on
            log.exception("%s %s failed", method, self.path)
            status, body, content_type = 500, {"status": "error", "message": f"{exc}"}, None
        self._send(status, body, content_type)

    def _send(self, status: int, body: Any, content_type: str | None) -> None:
        if isinstance(body, bytes):
            data, ctype = body, content_type or "application/octet-stream"
        elif isinstance(body, str):
            data, ctype = body.encode(), content_type or "text/html; charset=utf-8"
        else:
            data, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        if status == 401:
            self.send_header("WWW-Authenticate", 'Basic realm="dartboard-desktop"')
        if self.close_connection:  # the client must not send another request on it
            self.send_header("Connection", "close")
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    _cached_body: bytes | None = None

    def _body(self) -> bytes:
        if self._cached_body is not None:
            return self._cached_body
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True  # where its body ends is unknown
            raise Refused(400, {"error": "Content-Length must be an integer"}) from None
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            raise Refused(413, {"error": f"a body is at most {MAX_BODY_BYTES} bytes"})
        self._cached_body = self.rfile.read(length) if length else b""
        return self._cached_body

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self._body() or b"{}")
        except json.JSONDecodeError as exc:
            raise Refused(400, {"error": f"the body is not JSON ({exc.msg})"}) from None
        if not isinstance(data, dict):
            raise Refused(400, {"error": "the body must be a JSON object"})
        return data

    def form(self) -> dict[str, str]:
        fields = parse_qs(self._body().decode(errors="replace"))
        return {k: v[0] for k, v in fields.items()}

    def multipart(self) -> tuple[dict[str, str], dict[str, bytes]]:
        """(text fields, file fields) of a multipart/form-data body."""
        ctype = self.headers.get("Content-Type", "")
        if not ctype.startswith("multipart/form-data"):
            raise Refused(400, {"error": "file_path and file_data are required"})
        head = f"Content-Type: {ctype}\r\nMIME-Version: 1.0\r\n\r\n".encode()
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + self._body())
        fields: dict[str, str] = {}
        files: dict[str, bytes] = {}
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            payload = part.get_payload(decode=True)
            payload = payload if isinstance(payload, bytes) else b""
            if part.get_filename() is not None:
                files[str(name)] = payload
            else:
                fields[str(name)] = payload.decode(errors="replace")
        return fields, files

    @property
    def desktop(self) -> OSWorldDesktop:
        return self.server.desktop


Answer = tuple[int, Any, str | None]


def _command(data: dict[str, Any]) -> tuple[list[str] | str, bool]:
    shell = bool(data.get("shell", False))
    command = data.get("command", "" if shell else [])
    if isinstance(command, str) and not shell:
        command = shlex.split(command)  # as OSWorld's server does
    if isinstance(command, list) and not all(isinstance(a, str) for a in command):
        raise Refused(400, {"status": "error", "message": "command must be a list of strings"})
    if not command:
        raise Refused(400, {"status": "error", "message": "command is required"})
    return command, shell


def _cut(text: str, result: CommandResult) -> str:
    """`text` with OUTPUT_CUT after it when the sandbox cut the command's output."""
    if not result.truncated:
        return text
    separator = "\n" if text and not text.endswith("\n") else ""
    return f"{text}{separator}{OUTPUT_CUT}\n"


def _truncated(result: CommandResult) -> dict[str, bool]:
    return {"truncated": True} if result.truncated else {}


def execute(h: Handler) -> Answer:
    command, shell = _command(h.json())
    try:
        result = h.desktop.execute(command, shell=shell)
    except subprocess.TimeoutExpired as exc:
        return 500, {"status": "error", "message": f"timed out after {exc.timeout:g} s"}, None
    body = {"status": "success", "output": result.output, "error": _cut(result.error, result)}
    return 200, body | {"returncode": result.returncode} | _truncated(result), None


def run_python(h: Handler) -> Answer:
    code = h.json().get("code")
    if not code or not isinstance(code, str):
        return 400, {"status": "error", "message": "Code not supplied!"}, None
    try:
        result = h.desktop.execute(["/usr/bin/python3", "-c", code], timeout_s=30)
    except subprocess.TimeoutExpired:
        body = {"status": "error", "message": "Execution timeout: Code took too long to execute"}
        return 500, body | {"error": "TimeoutExpired", "need_more": False, "output": None}, None
    error = _cut(result.error, result)
    message = result.output + (("\n" if result.output else "") + error if error else "")
    return (
        200,
        {
            "status": "success" if result.returncode == 0 else "error",
            "message": message,
            "need_more": False,
            "output": result.output,
            "error": error,
            "return_code": result.returncode,
        }
        | _truncated(result),
        None,
    )


def run_bash_script(h: Handler) -> Answer:
    data = h.json()
    script, timeout = data.get("script"), data.get("timeout") or 100
    if not script or not isinstance(script, str):
        return (
            400,
            {"status": "error", "output": "Script not supplied!", "error": "", "returncode": -1},
            None,
        )
    workdir = vm_path(data["working_dir"]) if data.get("working_dir") else VM_HOME
    # The script and the directory travel as arguments, never spliced into shell text.
    wrapper = 'cd "$1" && exec /bin/bash -c "$2" 2>&1'
    try:
        result = h.desktop.execute(
            ["/bin/bash", "-c", wrapper, "bash", workdir, script],
            timeout_s=min(float(timeout), 600.0),
        )
    except subprocess.TimeoutExpired:
        body = {"status": "error", "output": f"Script execution timed out after {timeout} seconds"}
        return 500, body | {"error": "", "returncode": -1}, None
    status = "success" if result.returncode == 0 else "error"
    body = {"status": status, "output": _cut(result.output, result), "error": ""}
    return 200, body | {"returncode": result.returncode} | _truncated(result), None


def launch(h: Handler) -> Answer:
    command, _ = _command(h.json())  # a shell command arrives as one string: bash -c runs it
    h.desktop.launch(command)
    shown = command if isinstance(command, str) else " ".join(command)
    return 200, f"{shown} launched successfully", "text/html; charset=utf-8"


def get_file(h: Handler) -> Answer:
    path = h.form().get("file_path")
    if not path:
        return 400, {"error": "file_path is required"}, None
    try:
        return 200, h.desktop.read_file(path), "application/octet-stream"
    except DesktopFileError as exc:
        if exc.status == 404:
            return 404, {"error": "File not found"}, None
        raise


def upload(h: Handler) -> Answer:
    fields, files = h.multipart()
    if "file_path" not in fields or "file_data" not in files:
        return 400, {"error": "file_path and file_data are required"}, None
    size = h.desktop.write_file(fields["file_path"], files["file_data"])
    return 200, f"File Uploaded: {size} bytes", "text/html; charset=utf-8"


def list_directory(h: Handler) -> Answer:
    data = h.json()
    if "path" not in data:
        return 400, {"error": "Missing 'path' parameter"}, None
    try:
        return 200, {"directory_tree": h.desktop.list_directory(data["path"])}, None
    except DesktopFileError as exc:
        if exc.status == 400:
            return 400, {"error": "The provided path is not a directory"}, None
        raise


def open_file(h: Handler) -> Answer:
    path = h.json().get("path")
    if not path:
        return 400, "Path not supplied!", None
    h.desktop.open_file(path)
    return 200, "File opened and window activated successfully", None


def _window(h: Handler) -> str:
    data = h.json()
    name = data.get("window_name")
    if not name or not isinstance(name, str):
        raise Refused(400, "window_name required")
    window = h.desktop.find_window(
        name, strict=bool(data.get("strict")), by_class=bool(data.get("by_class"))
    )
    if window is None:
        raise Refused(404, f"Window {name} not found (empty results)")
    return window


def activate_window(h: Handler) -> Answer:
    h.desktop.activate_window(_window(h))
    return 200, "Window activated successfully", None


def close_window(h: Handler) -> Answer:
    h.desktop.close_window(_window(h))
    return 200, "Window closed successfully.", None


def window_size(h: Handler) -> Answer:
    name = h.form().get("app_class_name")
    if not name:
        return 400, {"error": "app_class_name is required"}, None
    size = h.desktop.window_size(name)
    if size is None:
        return 404, {"error": f"no window of class {name}"}, None
    return 200, {"width": size[0], "height": size[1]}, None


def screenshot(h: Handler) -> Answer:
    return 200, h.desktop.screenshot(), "image/png"


def screen_size(h: Handler) -> Answer:
    h._body()
    return 200, {"width": h.desktop.width, "height": h.desktop.height}, None


def desktop_path(h: Handler) -> Answer:
    h._body()
    return 200, {"desktop_path": f"{VM_HOME}/Desktop"}, None


def terminal(h: Handler) -> Answer:
    return 200, {"output": None, "status": "success"}, None


def platform(h: Handler) -> Answer:
    return 200, "Linux", "text/html; charset=utf-8"


def reset(h: Handler) -> Answer:
    h._body()
    h.desktop.reset()
    return 200, {"status": "success"}, None


def offers(h: Handler) -> Answer:
    return 200, {"offers": h.desktop.offers()}, None


ROUTES = {
    ("GET", "/screenshot"): screenshot,
    ("POST", "/screen_size"): screen_size,
    ("POST", "/execute"): execute,
    ("POST", "/setup/execute"): execute,
    ("POST", "/run_python"): run_python,
    ("POST", "/run_bash_script"): run_bash_script,
    ("POST", "/setup/launch"): launch,
    ("POST", "/file"): get_file,
    ("POST", "/setup/upload"): upload,
    ("POST", "/list_directory"): list_directory,
    ("POST", "/setup/open_file"): open_file,
    ("POST", "/setup/activate_window"): activate_window,
    ("POST", "/setup/close_window"): close_window,
    ("POST", "/window_size"): window_size,
    ("POST", "/desktop_path"): desktop_path,
    ("GET", "/terminal"): terminal,
    ("GET", "/platform"): platform,
    ("POST", "/dartboard/reset"): reset,
    ("GET", "/dartboard/offers"): offers,
}


class OSWorldHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS of them (see the module docstring)."""

    daemon_threads = True
    # The kernel's queue of connections not yet accepted. socketserver's 5 drops a burst's
    # handshakes (seen: 1 s connect retries at the 7th idle connection); accepting is cheap
    # now that a connection past the bound is answered 503 at once.
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], *, desktop: OSWorldDesktop, token: str) -> None:
        if not token:
            raise ValueError("a desktop server needs its token (DARTBOARD_DESKTOP_TOKEN)")
        super().__init__(address, Handler)
        self.desktop = desktop
        self.token = token
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        """On the accepting thread: a handler thread if a slot is free, else 503 and close."""
        if not self._slots.acquire(blocking=False):
            self._refuse_busy(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: nothing else will give the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse_busy(self, request: socket.socket) -> None:
        log.warning("refused a connection: %d connections are being served", MAX_CONNECTIONS)
        # Never blocks the accepting thread: the answer fits a fresh socket's send buffer,
        # and a client that cannot take it loses it.
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(BUSY_ANSWER)
        self.shutdown_request(request)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    token = os.environ.get("DARTBOARD_DESKTOP_TOKEN", "")
    if not token:
        sys.exit(
            "DARTBOARD_DESKTOP_TOKEN is not set: the desktop server refuses to start without it"
        )
    desktop = OSWorldDesktop()
    desktop.start()
    server = OSWorldHTTPServer((args.host, args.port), desktop=desktop, token=token)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    print(f"serving OSWorld's protocol on {host!s}:{port} (display {desktop.display})", flush=True)
    try:
        stop.wait()
    finally:
        server.shutdown()
        desktop.close()


if __name__ == "__main__":
    main()
