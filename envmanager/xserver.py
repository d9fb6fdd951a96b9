"""A private X display: Xvfb on a free display number plus the openbox window manager.

Xvfb picks the display itself (`-displayfd`: it binds the first free :N and writes N to a
pipe), so several desktops can start at once on one machine without racing on lock files.

    with XServer.start(width=800, height=600) as x:
        subprocess.run(["xdotool", "getmouselocation"], env=x.environ())
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from core.procutil import die_with_parent


class XServerError(RuntimeError):
    """Xvfb or openbox failed to start."""


@dataclass
class XServer:
    """A running Xvfb + openbox pair, owned (and stopped) by this process."""

    display: str
    width: int
    height: int
    xvfb: subprocess.Popen
    wm: subprocess.Popen | None

    @classmethod
    def start(cls, *, width: int, height: int, timeout_s: float = 10.0) -> XServer:
        """Start Xvfb on a free display and openbox on it; raise XServerError on failure."""
        read_fd, write_fd = os.pipe()
        try:
            xvfb = subprocess.Popen(
                [
                    "Xvfb",
                    "-displayfd",
                    str(write_fd),
                    "-screen",
                    "0",
                    f"{width}x{height}x24",
                    "-nolisten",
                    "tcp",
                    "-noreset",
                ],
                pass_fds=(write_fd,),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,  # a killed worker must not leave its X server
            )
        finally:
            os.close(write_fd)
        try:
            number = _read_display_number(read_fd=read_fd, timeout_s=timeout_s)
        except XServerError:
            _stop(xvfb)
            raise
        finally:
            os.close(read_fd)
        server = cls(display=f":{number}", width=width, height=height, xvfb=xvfb, wm=None)
        server.wm = subprocess.Popen(
            ["openbox", "--sm-disable"],
            env=server.environ(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        server._wait_for_wm(timeout_s=timeout_s)
        return server

    def environ(self) -> dict[str, str]:
        """os.environ with DISPLAY pointing at this server (for child processes)."""
        env = dict(os.environ)
        env["DISPLAY"] = self.display
        env.pop("WAYLAND_DISPLAY", None)
        return env

    @property
    def alive(self) -> bool:
        return self.xvfb.poll() is None

    def _wait_for_wm(self, *, timeout_s: float) -> None:
        # openbox sets _NET_SUPPORTING_WM_CHECK on the root window once it manages the screen.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            probe = subprocess.run(
                ["xprop", "-root", "_NET_SUPPORTING_WM_CHECK"],
                env=self.environ(),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            if "window id" in probe.stdout:
                return
            if self.wm is not None and self.wm.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise XServerError(f"openbox did not start on {self.display} within {timeout_s}s")

    def stop(self) -> None:
        """Stop openbox and Xvfb (by their own pids / process groups)."""
        if self.wm is not None:
            _stop(self.wm)
        _stop(self.xvfb)

    def __enter__(self) -> XServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_display_number(*, read_fd: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([read_fd], [], [], max(0.0, remaining))
        if not ready:
            raise XServerError(f"Xvfb did not report a display number within {timeout_s}s")
        chunk = os.read(read_fd, 64)
        if not chunk:
            raise XServerError("Xvfb exited before reporting a display number")
        data += chunk
    return int(data.strip())


def _stop(process: subprocess.Popen, *, grace_s: float = 2.0) -> None:
    """SIGTERM the process group we created (start_new_session), then SIGKILL if needed."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace_s)
