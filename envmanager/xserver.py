"""A private X display: Xvfb on a free display number, and openbox inside the desktop's sandbox.

Xvfb picks the display itself (`-displayfd`: it binds the first free :N and writes N to a
pipe), so several desktops can start at once on one machine without racing on lock files.
It demands a cookie (`-auth`: a random MIT-MAGIC-COOKIE-1 in a root-only file) and listens on
no TCP port. Its abstract socket stays: abstract sockets belong to a network namespace, and
every sandbox has its own, so no desktop reaches another's; on the host it is what makes
Xvfb skip a display number whose abstract name another process holds (clients try the
abstract socket first: with `-nolisten local` they would hand our cookie to a squatter, seen
when two Xvfbs in different mount namespaces both took :0). A sandbox sees its own display's
filesystem socket and an agent copy of the cookie, never another display's. Xvfb is the one
process of a desktop outside the sandbox.

The window manager is what the policy clicks on first, so it runs in the sandbox (the
desktop's uid and namespaces) with a configuration of its own (WM_RC): focus, raise, move,
resize, maximize and close only; no keyboard bindings, no menus, no action that executes a
program. Debian's default openbox configuration opens a menu on a right-click on the
background whose first entry starts a terminal; the sandbox has no /etc/xdg to fall back on.

The platform's own X clients (xdotool, scrot, xprop) run with `environ()`: DISPLAY,
XAUTHORITY and PATH, nothing of the worker's environment.

    x = XServer.start(width=800, height=600)
    jail = Sandbox(task_dir=..., display=x.display, xauth_cookie=x.cookie)
    x.start_wm(jail)
    subprocess.run(["xdotool", "getmouselocation"], env=x.environ())
    x.stop(); jail.close()
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.procutil import die_with_parent
from envmanager.sandbox import xauth_record
from envmanager.sandbox_limits import children, kill_same

if TYPE_CHECKING:
    from envmanager.sandbox import Sandbox

WM_DIR = "/opt/dartboard-wm"  # where the window manager's configuration appears inside
X_TOOLS_PATH = "/usr/bin:/bin"

# openbox's whole configuration. Mouse bindings only: none shows a menu or executes anything;
# <keyboard> is empty (alt+f2, ctrl+alt+t, alt+tab do nothing); the menu file is empty.
WM_RC = f"""<?xml version="1.0" encoding="UTF-8"?>
<openbox_config xmlns="http://openbox.org/3.4/rc">
  <focus><focusNew>yes</focusNew><followMouse>no</followMouse></focus>
  <placement><policy>Smart</policy></placement>
  <theme><name>Clearlooks</name><titleLayout>LMC</titleLayout></theme>
  <desktops><number>1</number></desktops>
  <keyboard></keyboard>
  <mouse>
    <dragThreshold>1</dragThreshold>
    <doubleClickTime>500</doubleClickTime>
    <context name="Client">
      <mousebind button="Left" action="Press"><action name="Focus"/><action name="Raise"/></mousebind>
      <mousebind button="Middle" action="Press"><action name="Focus"/><action name="Raise"/></mousebind>
      <mousebind button="Right" action="Press"><action name="Focus"/><action name="Raise"/></mousebind>
    </context>
    <context name="Titlebar">
      <mousebind button="Left" action="Press"><action name="Focus"/><action name="Raise"/></mousebind>
      <mousebind button="Left" action="Drag"><action name="Move"/></mousebind>
      <mousebind button="Left" action="DoubleClick"><action name="ToggleMaximize"/></mousebind>
    </context>
    <context name="Top"><mousebind button="Left" action="Drag"><action name="Resize"><edge>top</edge></action></mousebind></context>
    <context name="Left"><mousebind button="Left" action="Drag"><action name="Resize"><edge>left</edge></action></mousebind></context>
    <context name="Right"><mousebind button="Left" action="Drag"><action name="Resize"><edge>right</edge></action></mousebind></context>
    <context name="Bottom"><mousebind button="Left" action="Drag"><action name="Resize"><edge>bottom</edge></action></mousebind></context>
    <context name="BLCorner"><mousebind button="Left" action="Drag"><action name="Resize"/></mousebind></context>
    <context name="BRCorner"><mousebind button="Left" action="Drag"><action name="Resize"/></mousebind></context>
    <context name="TLCorner"><mousebind button="Left" action="Drag"><action name="Resize"/></mousebind></context>
    <context name="TRCorner"><mousebind button="Left" action="Drag"><action name="Resize"/></mousebind></context>
    <context name="Maximize"><mousebind button="Left" action="Click"><action name="ToggleMaximize"/></mousebind></context>
    <context name="Close"><mousebind button="Left" action="Click"><action name="Close"/></mousebind></context>
  </mouse>
  <menu><file>{WM_DIR}/menu.xml</file></menu>
</openbox_config>
"""
WM_MENU = """<?xml version="1.0" encoding="UTF-8"?>
<openbox_menu xmlns="http://openbox.org/3.4/menu"></openbox_menu>
"""


class XServerError(RuntimeError):
    """Xvfb or openbox failed to start."""


@dataclass
class XServer:
    """A running Xvfb (and, once `start_wm` ran, its sandboxed openbox), owned by this process."""

    display: str
    width: int
    height: int
    xvfb: subprocess.Popen
    cookie: bytes  # the display's MIT-MAGIC-COOKIE-1
    private_dir: Path  # root-only: the server's auth file and the WM configuration
    wm: subprocess.Popen | None = None

    @classmethod
    def start(cls, *, width: int, height: int, timeout_s: float = 10.0) -> XServer:
        """Start Xvfb on a free display, demanding a fresh cookie; raise XServerError."""
        private_dir = Path(tempfile.mkdtemp(prefix="dartboard-x-"))
        os.chmod(private_dir, 0o711)  # the sandbox's bwrap reaches the WM files by name
        cookie = secrets.token_bytes(16)
        auth = private_dir / "xvfb.auth"
        fd = os.open(auth, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(xauth_record(cookie))
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
                    "-auth",
                    str(auth),
                    "-nolisten",
                    "tcp",
                    "-noreset",
                ],
                pass_fds=(write_fd,),
                env={"PATH": X_TOOLS_PATH},
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
            shutil.rmtree(private_dir, ignore_errors=True)
            raise
        finally:
            os.close(read_fd)
        return cls(
            display=f":{number}",
            width=width,
            height=height,
            xvfb=xvfb,
            cookie=cookie,
            private_dir=private_dir,
        )

    def start_wm(self, jail: Sandbox, *, timeout_s: float = 10.0) -> None:
        """Start openbox inside `jail` with WM_RC and wait until it manages the screen."""
        wm_dir = self.private_dir / "wm"
        wm_dir.mkdir(mode=0o755, exist_ok=True)
        (wm_dir / "rc.xml").write_text(WM_RC)
        (wm_dir / "menu.xml").write_text(WM_MENU)
        for name in ("rc.xml", "menu.xml"):
            os.chmod(wm_dir / name, 0o644)
        self.wm = jail.popen(
            ["openbox", "--sm-disable", "--config-file", f"{WM_DIR}/rc.xml"],
            extra_ro_binds=((str(wm_dir), WM_DIR),),
        )
        self._wait_for_wm(timeout_s=timeout_s)

    def environ(self) -> dict[str, str]:
        """The environment of the platform's X clients: this display and its cookie, and a
        UTF-8 locale (without one, xdotool refuses any text beyond ASCII: "Invalid multi-byte
        sequence encountered")."""
        return {
            "DISPLAY": self.display,
            "XAUTHORITY": str(self.private_dir / "xvfb.auth"),
            "PATH": X_TOOLS_PATH,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
        }

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
        """Stop openbox and Xvfb (by their own pids / process groups), drop the cookie."""
        if self.wm is not None:
            _stop(self.wm)
        _stop(self.xvfb)
        shutil.rmtree(self.private_dir, ignore_errors=True)

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
    """SIGTERM the process group we created (start_new_session), then SIGKILL if needed;
    then its children that outlived it (a sandboxed app's: see `sandbox.kill_sandboxed`)."""
    if process.poll() is not None:
        return
    started = children(process.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=grace_s)
    kill_same(started)


class SandboxedDisplay:
    """What a desktop env and the OSWorld desktop both hold: an Xvfb, the sandbox its
    programs run in, and the apps a task started. Stopped apps first, then the display."""

    _x: XServer | None
    _jail: Sandbox | None
    _apps: list[subprocess.Popen]

    def _stop_apps(self) -> None:
        for app in self._apps:
            _stop(app, grace_s=1.0)
        self._apps = []

    def _stop_display(self) -> None:
        """Stop the task's apps, openbox and Xvfb, then free the sandbox; safe to call twice."""
        self._stop_apps()
        if self._x is not None:
            self._x.stop()
            self._x = None
        if self._jail is not None:
            self._jail.close()
            self._jail = None
