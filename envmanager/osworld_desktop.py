"""A Dartboard X desktop with what an OSWorld VM's server does to it, for `osworld_server`.

Xvfb (envmanager.xserver) at 1024x768, and the window manager and every program the policy
or a task runs inside the desktop's bubblewrap sandbox (envmanager.sandbox): a uid of its own, no network,
a clean environment, nothing of the host but /usr. The sandbox's home is /home/user (OSWorld
VMs' user), a host directory that lives until the next `reset`; /tmp in the sandbox is
private to each command. Read-only at /opt/dartboard: `bin/` (`python` for Debian's
python3, as OSWorld's `["python", "-c", ...]` expects; `dartedit FILE`, the Tk editor of
the desktop tasks; `dartbrowse FILE`, chromium on a local page) and `site/` (pyautogui and
python-xlib, pure Python, from requirements-sandbox.txt: OSWorld's pyautogui code runs on
/usr/bin/python3 inside the sandbox against this desktop's display).

The server never opens an agent's file itself: reads, uploads and listings run in the
sandbox too (`python3 -c` as the agent uid in its mount namespace), so a symlink to a host
file points nowhere. Paths must lie under /home/user (`PathRefused` otherwise, a 403).
xdotool and scrot (windows, screenshots) are the platform's, outside the sandbox, with
DISPLAY and XAUTHORITY as their only environment.

    desktop = OSWorldDesktop(); desktop.start(); desktop.reset()
    desktop.execute(["python", "-c", "import pyautogui; print(pyautogui.size())"])
"""

from __future__ import annotations

import html
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from envmanager.desktop_tasks import DARTAPP
from envmanager.sandbox import Sandbox, SandboxResult
from envmanager.sandbox_limits import SandboxLimits
from envmanager.xserver import SandboxedDisplay, XServer

WIDTH, HEIGHT = 1024, 768
VM_HOME = "/home/user"
TOOLS = "/opt/dartboard"
MAX_FILE_BYTES = 64 * 1024 * 1024  # /file and /setup/upload (the sandbox's RLIMIT_FSIZE too)
MAX_LISTED = 10_000  # entries of one /list_directory answer

_WRAPPERS = {
    "python": '#!/bin/sh\nexec /usr/bin/python3 "$@"\n',
    "dartedit": f'#!/bin/sh\nexec /usr/bin/python3 {TOOLS}/dartapp.py edit "$1"\n',
    "dartbrowse": (
        '#!/bin/sh\nexec chromium --app="file://$1" --user-data-dir=/tmp/chromium '
        "--no-sandbox --disable-gpu --disable-dev-shm-usage --disable-background-networking "
        "--no-first-run --no-default-browser-check --window-position=0,0 "
        f"--window-size={WIDTH},{HEIGHT}\n"
    ),
}
# LibreOffice finds its profile through the passwd entry of its uid, which the sandbox's uid
# has none of (it aborts); OSWorld's VMs keep it at ~/.config/libreoffice/4/user, where their
# getters read it. Chrome is Debian's Chromium here, with the flags the sandbox needs.
_OFFICE = (
    f'exec /usr/bin/libreoffice -env:UserInstallation=file://{VM_HOME}/.config/libreoffice/4 "$@"\n'
)
_WRAPPERS |= {
    "libreoffice": "#!/bin/sh\n" + _OFFICE,
    "soffice": "#!/bin/sh\n" + _OFFICE,
    "google-chrome": (
        '#!/bin/sh\nexec chromium --user-data-dir="$HOME/.config/google-chrome" --no-sandbox '
        "--disable-gpu --disable-dev-shm-usage --disable-background-networking --no-first-run "
        '--no-default-browser-check "$@"\n'
    ),
}
TEXT_SUFFIXES = (".txt", ".md", ".py", ".csv", ".json", ".log", ".sh", ".ini", ".cfg", "")
# A new LibreOffice profile as an OSWorld VM's is: no tip-of-the-day dialog over the
# document, no what's-new bar (the last version seen is later than any installed).
OFFICE_PROFILE = f"{VM_HOME}/.config/libreoffice/4/user/registrymodifications.xcu"
_OFFICE_SETTINGS = """<?xml version="1.0" encoding="UTF-8"?>
<oor:items xmlns:oor="http://openoffice.org/2001/registry" xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="ShowTipOfTheDay" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Setup/Product"><prop oor:name="ooSetupLastVersion" oor:op="fuse"><value>99.0</value></prop></item>
</oor:items>
"""
# VLC's first start asks about network access in a dialog over the player; OSWorld's VMs
# have answered it (their vlc_config getter reads this file).
VLC_SETTINGS = f"{VM_HOME}/.config/vlc/vlcrc"
_VLC_SETTINGS = "[qt]\nqt-privacy-ask=0\n"
# The applications a desktop offers tasks (envmanager.osworld_needs's `app:<name>`), by the
# program that must be installed (`make desktop-apps`). Chrome's debugging port, the
# accessibility tree and VLC's HTTP interface are not offered: the sandbox has no network
# (nothing outside reaches a port inside) and no AT-SPI bus.
DESKTOP_APPS = {
    "chrome": "chromium",
    "libreoffice": "libreoffice",
    "gimp": "gimp",
    "vlc": "vlc",
    "thunderbird": "thunderbird",
}
# What opens a file of these suffixes, as an OSWorld VM's desktop opens it (xdg-open there).
OFFICE_SUFFIXES = {
    **dict.fromkeys((".xlsx", ".xls", ".ods"), "--calc"),
    **dict.fromkeys((".docx", ".doc", ".odt"), "--writer"),
    **dict.fromkeys((".pptx", ".ppt", ".odp"), "--impress"),
}

# Run inside the sandbox as the agent: the file's bytes on stdout, or an exit code saying why.
_READ = """import os, stat, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)
except FileNotFoundError:
    sys.exit(2)
if not stat.S_ISREG(os.fstat(fd).st_mode):
    sys.exit(3)
data = os.read(fd, int(sys.argv[2]) + 1)
while len(data) <= int(sys.argv[2]):
    more = os.read(fd, 1 << 20)
    if not more:
        break
    data += more
if len(data) > int(sys.argv[2]):
    sys.exit(4)
sys.stdout.buffer.write(data)
"""
_WRITE = """import os, sys
os.makedirs(os.path.dirname(sys.argv[1]) or ".", exist_ok=True)
with open(sys.argv[1], "wb") as f:
    f.write(sys.stdin.buffer.read())
print(os.path.getsize(sys.argv[1]))
"""
_LIST = """import json, os, sys
budget = [int(sys.argv[2])]
def tree(path):
    node = {"type": "directory", "name": os.path.basename(path), "children": []}
    for entry in sorted(os.listdir(path)):
        budget[0] -= 1
        if budget[0] < 0:
            raise SystemExit(4)
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            node["children"].append(tree(full))
        else:
            node["children"].append({"type": "file", "name": entry})
    return node
if not os.path.isdir(sys.argv[1]):
    sys.exit(3)
print(json.dumps(tree(sys.argv[1])))
"""


class PathRefused(ValueError):
    """A path outside the desktop's home (a 403)."""


class DesktopFileError(ValueError):
    """A file request that cannot be served; `status` is its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class CommandResult:
    output: str
    error: str
    returncode: int
    truncated: bool = False  # output passed the sandbox's cap: cut, and the command killed


def vm_path(raw: str) -> str:
    """`raw` (absolute, ~ or $HOME) as a normalised path under VM_HOME; PathRefused if not."""
    if not isinstance(raw, str) or not raw:
        raise PathRefused("a path is required")
    path = raw
    if path == "~" or path.startswith("~/"):
        path = VM_HOME + path[1:]
    path = path.replace("$HOME", VM_HOME).replace("${HOME}", VM_HOME)
    path = posixpath.normpath(path)
    if path != VM_HOME and not path.startswith(VM_HOME + "/"):
        raise PathRefused(
            f"{raw!r} is outside the desktop's home {VM_HOME}: files are read and written "
            f"only under it"
        )
    return path


def _expand_home(command: list[str]) -> list[str]:
    """OSWorld's server expands a leading ~/ of each argument."""
    return [VM_HOME + arg[1:] if arg.startswith("~/") else arg for arg in command]


class OSWorldDesktop(SandboxedDisplay):
    """One desktop served by `osworld_server`: X server, sandbox, the apps it launched."""

    def __init__(
        self,
        *,
        width: int = WIDTH,
        height: int = HEIGHT,
        limits: SandboxLimits = SandboxLimits(),
        command_timeout_s: float = 60.0,
    ) -> None:
        self.width, self.height = width, height
        self.limits = limits
        self.command_timeout_s = command_timeout_s
        self._root = Path(tempfile.mkdtemp(prefix="dartboard-osworld-"))
        self._x: XServer | None = None
        self._jail: Sandbox | None = None
        self._apps: list[subprocess.Popen] = []
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="desktop-apps")

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        tools = self._root / "tools"
        (tools / "bin").mkdir(parents=True)
        (tools / "site").mkdir()  # the mount point of site/ (a read-only parent cannot grow one)
        (tools / "dartapp.py").write_text(DARTAPP)
        for name, text in _WRAPPERS.items():
            (tools / "bin" / name).write_text(text)
            (tools / "bin" / name).chmod(0o755)
        os.chmod(self._root, 0o711)
        site = Path(sys.prefix) / "sandbox-site"
        if not (site / "pyautogui").is_dir():
            raise RuntimeError(
                f"{site} has no pyautogui: `make install` installs requirements-sandbox.txt there"
            )
        self._x = XServer.start(width=self.width, height=self.height)
        self._jail = Sandbox(
            task_dir=self._root / "home",
            display=self._x.display,
            xauth_cookie=self._x.cookie,
            limits=self.limits,
            mount_at=VM_HOME,
            home=VM_HOME,
            ro_binds=((str(tools), TOOLS), (str(site), f"{TOOLS}/site")),
            extra_env=(("PYTHONPATH", f"{TOOLS}/site"), ("PATH", f"{TOOLS}/bin:/usr/bin:/bin")),
        )
        self._x.start_wm(self._jail)
        self.reset()

    def reset(self) -> None:
        """Stop every launched app and give the sandbox an empty home (with ~/Desktop)."""
        self._stop_apps()
        jail = self._sandbox()
        jail.prepare_task_dir()
        desktop = jail.task_dir / "Desktop"
        desktop.mkdir()
        os.chown(desktop, jail.uid, jail.uid)
        if shutil.which("libreoffice"):
            self.write_file(OFFICE_PROFILE, _OFFICE_SETTINGS.encode())
        if shutil.which("vlc"):
            self.write_file(VLC_SETTINGS, _VLC_SETTINGS.encode())

    def close(self) -> None:
        self._stop_display()
        self._spawner.shutdown(wait=False)
        shutil.rmtree(self._root, ignore_errors=True)

    def _sandbox(self) -> Sandbox:
        if self._jail is None or self._x is None or not self._x.alive:
            raise RuntimeError("the desktop's X server is not running")
        return self._jail

    @property
    def display(self) -> str:
        if self._x is None:
            raise RuntimeError("the desktop is not started")
        return self._x.display

    def offers(self) -> list[str]:
        """What this desktop offers tasks: the applications installed on this host."""
        return sorted(
            f"app:{app}" for app, program in DESKTOP_APPS.items() if shutil.which(program)
        )

    # ------------------------------------------------------------------ programs

    def execute(
        self, command: list[str] | str, *, shell: bool = False, timeout_s: float | None = None
    ) -> CommandResult:
        """Run a command in the sandbox to completion (OSWorld's /execute and /setup/execute).
        Raises subprocess.TimeoutExpired past the timeout."""
        argv = ["/bin/bash", "-c", command] if isinstance(command, str) else _expand_home(command)
        done = self._sandbox().run(argv, timeout_s=timeout_s or self.command_timeout_s)
        return CommandResult(
            output=done.stdout.decode(errors="replace"),
            error=done.stderr.decode(errors="replace"),
            returncode=done.returncode,
            truncated=done.truncated,
        )

    def launch(self, command: list[str] | str) -> None:
        """Start a program in the sandbox and leave it running (OSWorld's /setup/launch).

        Started from the desktop's own long-lived thread: the sandbox's death signal
        (PR_SET_PDEATHSIG) fires when the *thread* that forked it ends, and the HTTP server
        serves each request on a thread that ends with it (seen: editors vanished as soon as
        /setup/open_file answered)."""
        argv = ["/bin/bash", "-c", command] if isinstance(command, str) else _expand_home(command)
        jail = self._sandbox()
        self._apps.append(self._spawner.submit(jail.popen, argv).result())

    def open_file(self, raw_path: str, *, timeout_s: float = 30.0) -> str:
        """Open a file with this desktop's app for it (the editor for text, chromium for
        HTML, LibreOffice for office documents where installed) and wait for its window;
        returns the window's title."""
        path = vm_path(raw_path)
        name = posixpath.basename(path)
        suffix = posixpath.splitext(name)[1]
        browser = suffix in (".html", ".htm")
        if browser:
            # Chromium's window shows before its page, titled with the page's address: on a
            # loaded machine a first click could land on a blank window. It takes the page's
            # <title> once it has read it, so the wait is for that title (for the address,
            # which holds the file's name, when the page has none).
            wait_for = _html_title(self.read_file(path)) or name
            self.launch(["dartbrowse", path])
        elif suffix in TEXT_SUFFIXES:
            self.launch(["dartedit", path])
            wait_for = name
        elif suffix.lower() in OFFICE_SUFFIXES and shutil.which("libreoffice"):
            self.launch(["libreoffice", OFFICE_SUFFIXES[suffix.lower()], path])
            wait_for = f"{name} - LibreOffice"
        else:
            raise DesktopFileError(
                f"no application on this desktop opens {suffix} files (`make desktop-apps` "
                "installs LibreOffice for office documents)",
                404,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for window, title in self.windows():
                if wait_for in title and (not browser or self._is_chromium(window)):
                    self._xdotool(["windowactivate", window])
                    return title
            time.sleep(0.1)
        raise DesktopFileError(f"no window for {name} within {timeout_s:g} s", 500)

    # ------------------------------------------------------------------ screen and windows

    def screenshot(self) -> bytes:
        return self._x_tool(["scrot", "--overwrite", "-"])

    def windows(self) -> list[tuple[str, str]]:
        """(window id, title) of the visible windows."""
        out = subprocess.run(
            ["xdotool", "search", "--onlyvisible", "--name", "."],
            env=self._x_environ(),
            capture_output=True,
            timeout=10,
        ).stdout.decode()
        found = []
        for window in out.split():
            title = subprocess.run(
                ["xdotool", "getwindowname", window],
                env=self._x_environ(),
                capture_output=True,
                timeout=10,
            ).stdout.decode(errors="replace")
            found.append((window, title.strip()))
        return found

    def find_window(self, name: str, *, strict: bool, by_class: bool) -> str | None:
        """The first visible window whose title (or class) contains `name` (equals it when
        strict), as OSWorld's server matches them with wmctrl."""
        flag = "--class" if by_class else "--name"
        pattern = f"^{re.escape(name)}$" if strict else re.escape(name)
        out = subprocess.run(
            ["xdotool", "search", "--onlyvisible", flag, pattern],
            env=self._x_environ(),
            capture_output=True,
            timeout=10,
        ).stdout.decode()
        return out.split()[0] if out.split() else None

    def activate_window(self, window: str) -> None:
        self._xdotool(["windowactivate", "--sync", window])

    def close_window(self, window: str) -> None:
        self._xdotool(["windowclose", window])

    def window_size(self, app_class: str) -> tuple[int, int] | None:
        window = self.find_window(app_class, strict=False, by_class=True)
        if window is None:
            return None
        out = self._x_tool(["xdotool", "getwindowgeometry", "--shell", window]).decode()
        values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        return int(values["WIDTH"]), int(values["HEIGHT"])

    def _is_chromium(self, window: str) -> bool:
        out = subprocess.run(
            ["xprop", "-id", window, "WM_CLASS"],
            env=self._x_environ(),
            capture_output=True,
            timeout=10,
        ).stdout.decode()
        return "chromium" in out.lower()

    def _xdotool(self, args: list[str]) -> None:
        self._x_tool(["xdotool", *args])

    def _x_tool(self, argv: list[str]) -> bytes:
        done = subprocess.run(argv, env=self._x_environ(), capture_output=True, timeout=10)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} {argv[1]} failed: {done.stderr.decode().strip()}")
        return done.stdout

    def _x_environ(self) -> dict[str, str]:
        if self._x is None or not self._x.alive:
            raise RuntimeError("the desktop's X server is not running")
        return self._x.environ()

    # ------------------------------------------------------------------ files (in the sandbox)

    def read_file(self, raw_path: str) -> bytes:
        path = vm_path(raw_path)
        done = self._sandbox().run(
            ["/usr/bin/python3", "-c", _READ, path, str(MAX_FILE_BYTES)], timeout_s=30
        )
        return _file_answer(done, path, what="read")

    def write_file(self, raw_path: str, data: bytes) -> int:
        path = vm_path(raw_path)
        if len(data) > MAX_FILE_BYTES:
            raise DesktopFileError(f"{path}: larger than {MAX_FILE_BYTES} bytes", 413)
        done = self._sandbox().run(
            ["/usr/bin/python3", "-c", _WRITE, path], timeout_s=60, stdin=data
        )
        return int(_file_answer(done, path, what="write"))

    def list_directory(self, raw_path: str) -> dict:
        path = vm_path(raw_path)
        done = self._sandbox().run(
            ["/usr/bin/python3", "-c", _LIST, path, str(MAX_LISTED)], timeout_s=30
        )
        return json.loads(_file_answer(done, path, what="list"))


def _html_title(page: bytes) -> str:
    """The <title> of an HTML page as a browser shows it ("" when it has none)."""
    found = re.search(rb"<title[^>]*>(.*?)</title", page, re.IGNORECASE | re.DOTALL)
    if not found:
        return ""
    return " ".join(html.unescape(found.group(1).decode("utf-8", "replace")).split())


def _file_answer(done: SandboxResult, path: str, *, what: str) -> bytes:
    if done.returncode == 0:
        return done.stdout
    reasons = {
        2: (f"{path}: file not found", 404),
        3: (f"{path}: not a regular file" if what == "read" else f"{path}: not a directory", 400),
        4: (f"{path}: larger than the limit", 413),
    }
    if done.returncode in reasons:
        raise DesktopFileError(*reasons[done.returncode])
    detail = done.stderr.decode(errors="replace").strip().splitlines()
    raise DesktopFileError(
        f"{path}: cannot {what} ({detail[-1] if detail else done.returncode})", 400
    )
