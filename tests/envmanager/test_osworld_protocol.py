"""OSWorld's own client (the desktop-env wheel's PythonController and SetupController, not a
copy) drives a sandboxed Dartboard desktop over real HTTP and gets what it expects from an
OSWorld VM; without the token nothing answers, and what it runs cannot reach a secret of
the server's environment, the network or a file outside the desktop's home."""

from __future__ import annotations

import io
import json
import socket
import threading

import pytest
import requests
from PIL import Image

from envmanager.osworld_desktop import OSWorldDesktop
from envmanager.osworld_wheel import wheel
from envmanager.sandbox_limits import AGENT_UID_BASE, AGENT_UID_COUNT
from tests.osworld_desktop import PLANTED_SECRET

pytestmark = [pytest.mark.desktop]
PAGE = ("import sys; open(sys.argv[1], 'w').write('<html><head><title>Q3 &amp;\\n figures"
        "</title></head><body>figures</body></html>')")  # fmt: skip


@pytest.fixture
def controller(osworld_desktop):
    c = wheel().python_controller(osworld_desktop.vm_ip, osworld_desktop.port)
    c.retry_times, c.retry_interval = 1, 0.1  # a refusal is the answer under test
    requests.post(f"http://{osworld_desktop.address}/dartboard/reset", auth=_auth(osworld_desktop))
    return c


def _auth(server):
    return ("dartboard", server.token)


def test_python_controller_gets_screenshots_commands_and_files(controller, osworld_desktop):
    png = controller.get_screenshot()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(io.BytesIO(png)).size == (1024, 768)
    assert controller.get_vm_screen_size() == {"width": 1024, "height": 768}
    # OSWorld runs ["python", "-c", "import pyautogui; ...; <code>"] through /execute.
    answer = controller.execute_python_command("print(pyautogui.size(), pyautogui.position())")
    assert set(answer) == {"status", "output", "error", "returncode"}
    assert answer["status"] == "success" and answer["returncode"] == 0, answer
    assert answer["output"].startswith("Size(width=1024, height=768)")
    script = controller.run_bash_script(
        "printf 'one\\ntwo\\n' > ~/Desktop/n.txt; echo made; exit 3"
    )
    assert script == {"status": "error", "output": "made\n", "error": "", "returncode": 3}
    assert controller.get_file("/home/user/Desktop/n.txt") == b"one\ntwo\n"
    assert controller.get_file("~/Desktop/n.txt") == b"one\ntwo\n"
    assert controller.get_file("/home/user/missing.txt") is None
    tree = controller.get_vm_directory_tree("/home/user")
    assert tree["name"] == "user" and {"type": "directory", "name": "Desktop", "children": [
        {"type": "file", "name": "n.txt"}]} in tree["children"]  # fmt: skip
    run = controller.run_python_script("import sys; print(sys.version_info[0])")
    assert run["status"] == "success" and run["output"] == "3\n" and run["return_code"] == 0
    assert controller.get_vm_desktop_path() == "/home/user/Desktop"
    assert controller.get_terminal_output() is None  # OSWorld's answer with no focused terminal


def test_setup_controller_uploads_runs_launches_and_opens(controller, osworld_desktop, tmp_path):
    local = tmp_path / "report.txt"
    local.write_text("quarterly figures\n")
    setup = wheel().setup_controller(
        vm_ip=osworld_desktop.vm_ip, server_port=osworld_desktop.port, cache_dir=str(tmp_path)
    )
    assert setup.setup(
        [
            {"type": "upload_file", "parameters": {"files": [
                {"local_path": str(local), "path": "/home/user/docs/report.txt"}]}},
            {"type": "execute", "parameters": {"command": ["bash", "-c", "wc -c < ~/docs/report.txt"],
                                               "stdout": "size.txt"}},
            {"type": "launch", "parameters": {"command": ["xterm", "-T", "setup-term"]}},
            {"type": "execute", "parameters": {
                "command": ["xdotool", "search", "--onlyvisible", "--name", "setup-term"],
                "until": {"returncode": 0}}},
            {"type": "activate_window", "parameters": {"window_name": "setup-term"}},
            {"type": "open", "parameters": {"path": "/home/user/docs/report.txt"}},
            {"type": "execute", "parameters": {"command": ["python3", "-c", PAGE, "/home/user/q.html"]}},
            {"type": "open", "parameters": {"path": "/home/user/q.html"}},
        ]
    )  # fmt: skip
    assert controller.get_file("/home/user/docs/report.txt") == b"quarterly figures\n"
    assert (tmp_path / "size.txt").read_text() == "18\n"  # /setup/execute's output
    titles = controller.execute_python_command(
        "import subprocess; print(subprocess.run(['xdotool', 'search', '--onlyvisible', "
        "'--name', '.', 'getwindowname', '%@'], capture_output=True, text=True).stdout)"
    )["output"]
    assert "setup-term" in titles and "dartedit - report.txt" in titles
    # A page opens once chromium has read it: its window has the page's title.
    assert "Q3 &amp; figures" not in titles and "Q3 & figures" in titles


@pytest.mark.parametrize(
    "method, path", [("get", "/screenshot"), ("post", "/execute"), ("post", "/file")]
)
def test_every_route_needs_the_token(osworld_desktop, method, path):
    url = f"http://{osworld_desktop.address}{path}"
    body = {"json": {"command": ["id"]}} if path == "/execute" else {}
    assert getattr(requests, method)(url, **body).status_code == 401
    wrong = getattr(requests, method)(url, auth=("dartboard", "not-the-token"), **body)
    assert wrong.status_code == 401
    bearer = {"Authorization": f"Bearer {osworld_desktop.token}"}
    assert getattr(requests, method)(url, headers=bearer, **body).status_code != 401


def test_execute_sees_no_secret_and_no_network(controller, osworld_desktop):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    reached = threading.Event()
    threading.Thread(target=lambda: (listener.accept(), reached.set()), daemon=True).start()
    probe = (
        "import os, json, socket\n"
        "out = {'uid': os.getuid(), 'env': dict(os.environ)}\n"
        "out['pid1'] = open('/proc/1/environ').read()\n"
        "for port in PORTS:\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=2); out[port] = 'open'\n"
        "    except OSError as exc:\n"
        "        out[port] = str(exc)\n"
        "print(json.dumps(out))\n"
    ).replace("PORTS", repr((listener.getsockname()[1], osworld_desktop.port)))
    answer = controller.run_python_script(probe)
    assert answer["status"] == "success", answer
    out = json.loads(answer["output"])
    assert AGENT_UID_BASE <= out["uid"] < AGENT_UID_BASE + AGENT_UID_COUNT
    assert PLANTED_SECRET not in answer["output"]
    assert set(out["env"]) <= {"DISPLAY", "XAUTHORITY", "HOME", "PATH", "LANG", "PYTHONPATH", "PWD"}
    assert (
        out[str(listener.getsockname()[1])] != "open" and out[str(osworld_desktop.port)] != "open"
    )
    assert not reached.is_set()
    listener.close()


def test_files_stay_inside_the_desktops_home(controller, osworld_desktop, tmp_path):
    auth = _auth(osworld_desktop)
    url = f"http://{osworld_desktop.address}"
    outside = requests.post(
        f"{url}/file", data={"file_path": "/home/user/../../etc/passwd"}, auth=auth
    )
    assert outside.status_code == 403 and "outside the desktop's home" in outside.json()["error"]
    up = requests.post(
        f"{url}/setup/upload",
        files={"file_data": ("x", b"owned")},
        data={"file_path": "/tmp/../root/x"},
        auth=auth,
    )
    assert up.status_code == 403
    # A link to a host file the server could read: read as the agent, it points nowhere.
    secret = tmp_path / "host-secret.txt"
    secret.write_text(PLANTED_SECRET)
    controller.run_bash_script(f"ln -s {secret} ~/link.txt; ln -s /proc/1/environ ~/env.txt")
    linked = requests.post(f"{url}/file", data={"file_path": "~/link.txt"}, auth=auth)
    assert linked.status_code == 404
    environ = requests.post(f"{url}/file", data={"file_path": "~/env.txt"}, auth=auth)
    assert PLANTED_SECRET.encode() not in environ.content


def test_a_page_is_open_once_chromium_has_read_it():
    """Chromium's window shows before its page (titled with its address until then): the
    setup's next action must meet the page, so /setup/open_file waits for the page's title."""
    desktop = OSWorldDesktop()
    desktop.start()
    try:
        desktop.reset()
        desktop.write_file("/home/user/q.html", b"<html><head><title lang=en>Q3 &amp;\n figures"
                           b"</TITLE></head><body>figures</body></html>")  # fmt: skip
        assert desktop.open_file("/home/user/q.html") == "Q3 & figures"
        desktop.write_file("/home/user/plain.html", b"<html><body>no title</body></html>")
        assert "plain.html" in desktop.open_file("/home/user/plain.html")  # its address
    finally:
        desktop.close()
