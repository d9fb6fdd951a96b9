"""The web server as `make run` starts it (`dartboard.serve`) holds the request body limits
while a body arrives: a 1 GiB upload is refused with 413 after little more than its limit has
been sent, the server neither holds it in memory nor writes it to a file, and the largest
legitimate upload still imports."""

from __future__ import annotations

import io
import json
import os
import stat
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.contrib.auth.hashers import PBKDF2PasswordHasher

from dartboard.body_limit import UPLOAD_PATH, path_limits
from datamanager.archive import MAX_UPLOAD_BYTES
from datamanager.models import Task, Trajectory
from tests.conftest import png_bytes
from tests.dartboard.test_browser import running_web_process

pytestmark = pytest.mark.slow

MiB = 2**20
UPLOAD_LIMIT = path_limits()[UPLOAD_PATH]


class ServerWatch:
    """Samples, every 20 ms on a thread, the largest regular file a process holds open
    (temporary files included, though unlinked) and the largest file under its TMPDIR; its
    peak resident memory is the kernel's (VmHWM)."""

    def __init__(self, pid: int, tmpdir: Path) -> None:
        self.pid, self.tmpdir = pid, tmpdir
        self.largest_file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def memory_kib(self, field: str) -> int:
        """VmRSS (now) or VmHWM (peak) from /proc/PID/status, in KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.pid}/status")

    def _sizes(self) -> Iterator[int]:
        fds = Path(f"/proc/{self.pid}/fd")
        for fd in os.listdir(fds):
            try:
                st = os.stat(fds / fd)
            except OSError:  # closed since the listing
                continue
            if stat.S_ISREG(st.st_mode):
                yield st.st_size
        for path in self.tmpdir.rglob("*"):
            try:
                yield path.stat().st_size
            except OSError:
                continue

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.largest_file = max(self.largest_file, *self._sizes(), 0)

    def __enter__(self) -> ServerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Sender:
    """A request body of `total` bytes in 1 MiB chunks, counting what the client sent."""

    def __init__(self, total: int) -> None:
        self.total, self.sent = total, 0

    def __iter__(self) -> Iterator[bytes]:
        chunk = b"x" * MiB
        while self.sent < self.total:
            self.sent += len(chunk)
            yield chunk


@pytest.fixture
def web(subprocess_env, tmp_path):
    """(url, ServerWatch) of a web server whose temporary files go to its own TMPDIR."""
    tmpdir = tmp_path / "server-tmp"
    tmpdir.mkdir()
    with running_web_process({**subprocess_env, "TMPDIR": str(tmpdir)}) as (url, proc):
        yield url, ServerWatch(proc.pid, tmpdir)


def test_a_1_gib_upload_is_refused_while_it_streams(web) -> None:
    url, watch = web
    before_kib = watch.memory_kib("VmRSS")
    with watch, httpx.Client(timeout=120) as client:
        declared = Sender(2**30)
        r = client.post(
            f"{url}{UPLOAD_PATH}", content=declared, headers={"Content-Length": str(2**30)}
        )
        assert r.status_code == 413, r.text
        assert declared.sent < 32 * MiB  # refused on its Content-Length, not on its bytes

        chunked = Sender(2**30)  # no length: chunked transfer encoding
        r = client.post(f"{url}{UPLOAD_PATH}", content=chunked)
        assert r.status_code == 413, r.text
        assert f"at most {UPLOAD_LIMIT} bytes" in r.text
        # The client stops a socket buffer or two past the limit.
        assert UPLOAD_LIMIT < chunked.sent < UPLOAD_LIMIT + 32 * MiB
    peak_growth_mib = (watch.memory_kib("VmHWM") - before_kib) / 1024
    assert peak_growth_mib < 64, f"the server's memory grew by {peak_growth_mib:.0f} MiB"
    # Django spools what the limit let by; never the gigabyte.
    assert watch.largest_file <= UPLOAD_LIMIT, f"a {watch.largest_file / MiB:.0f} MiB file"
    assert httpx.get(f"{url}/health/").status_code == 200


def test_the_largest_legitimate_upload_is_imported(web, researcher, tmp_path) -> None:
    url, _ = web
    Task.objects.create(name="click-button", env_kind="miniwob", instruction="Click OK")
    # The server runs the project's settings (PBKDF2), the suite MD5: store a PBKDF2 hash.
    researcher.password = PBKDF2PasswordHasher().encode("lovelace-pass-1", "salt", iterations=1000)
    researcher.save(update_fields=["password"])
    archive = _demo_zip(tmp_path / "demos.zip", size=MAX_UPLOAD_BYTES)
    with httpx.Client(base_url=url, timeout=300) as client:
        client.get("/accounts/login/")
        r = client.post(
            "/accounts/login/",
            data={"username": "ada", "password": "lovelace-pass-1",
                  "csrfmiddlewaretoken": client.cookies["csrftoken"]},
        )  # fmt: skip
        assert r.status_code == 302, r.text[-2000:]
        client.get(UPLOAD_PATH)
        with archive.open("rb") as fh:
            r = client.post(
                UPLOAD_PATH,
                data={"format": "dartboard", "accept": "on",
                      "csrfmiddlewaretoken": client.cookies["csrftoken"]},
                files={"archive": ("demos.zip", fh, "application/zip")},
            )  # fmt: skip
    assert r.status_code == 302, r.text[-2000:]
    body = int(r.request.headers["Content-Length"])
    assert MAX_UPLOAD_BYTES < body <= UPLOAD_LIMIT
    assert Trajectory.objects.filter(source="precollected", task__name="click-button").count() == 1


def _demo_zip(path: Path, *, size: int) -> Path:
    """A Dartboard archive of exactly `size` bytes: one episode and a stored padding member,
    which the import leaves alone."""
    episodes = [{"task": "click-button", "reward": 1.0,
                 "steps": [{"screenshot": "s.png", "action": {"type": "wait"}}]}]  # fmt: skip

    def write(fh, padding: int) -> None:
        with zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr("manifest.json", json.dumps(episodes))
            zf.writestr("s.png", png_bytes())
            with zf.open("padding.bin", "w") as member:
                for start in range(0, padding, MiB):
                    member.write(b"\0" * min(MiB, padding - start))

    empty = io.BytesIO()
    write(empty, 0)
    with path.open("wb") as fh:
        write(fh, size - len(empty.getvalue()))
    assert path.stat().st_size == size
    return path
