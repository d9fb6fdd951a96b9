"""What an OSWorld task needs of the desktop it runs on, beyond OSWorld's basic in-VM server.

A task imports whatever it needs; what it needs is recorded with it (`task_needs`, stored
in the task's env_config as "needs") and a run gives its tasks only to slots that offer it
(`env.osworld_offers`, an OSWorld VM image's by default): a run with a task no slot of it can
host is refused at create, naming the tasks and what they lack. The vocabulary:

- `app:<name>`: the application is installed (chrome, libreoffice, gimp, vlc, thunderbird,
  vscode, nautilus), read from the task's `launch` steps, the files it `open`s and its
  `related_apps`;
- `chrome_cdp`: Chrome listens for the DevTools protocol (OSWorld's port 9222, forwarded by
  socat to the VM's 1337), which the chrome setup steps and getters drive;
- `accessibility_tree`: the desktop's `/accessibility` answers an AT-SPI tree;
- `vlc_http`: VLC's HTTP interface (port 8080) answers;
- `internet`: the desktop reaches public websites (a tab the task opens, a site a getter
  browses);
- `google_drive`: a Google account's settings file (the googledrive and login steps, the
  googledrive_file getter): Dartboard never hands the policy's desktop an account;
- `worker_internet`: the env worker itself reaches a public host (a step that fetches from
  one, a relative-time rule without a timezone, which asks ipapi.co for one).

Files a task fetches by URL are not a need of the slot: they come from the file cache
(envmanager.osworld_file_cache), and the importer flags those missing there.

    task_needs(json.load(open("evaluation_examples/examples/chrome/<id>.json")))
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlparse

APPS = ("chrome", "libreoffice", "gimp", "vlc", "thunderbird", "vscode", "nautilus")
# What an OSWorld VM image (its Ubuntu snapshot) has: the default of env.osworld_offers.
OSWORLD_VM_OFFERS = (
    *(f"app:{app}" for app in APPS),
    "chrome_cdp",
    "accessibility_tree",
    "vlc_http",
)
CAPABILITIES = (*OSWORLD_VM_OFFERS, "internet", "google_drive", "worker_internet")

_CHROME_FILE = ("app:chrome",)  # reads Chrome's preferences, bookmarks, cookies or history
GETTER_NEEDS: dict[str, tuple[str, ...]] = {
    "accessibility_tree": ("accessibility_tree",),
    "active_tab_html_parse": ("accessibility_tree", "chrome_cdp"),
    "active_tab_info": ("accessibility_tree", "chrome_cdp", "internet"),
    "active_tab_url_parse": ("accessibility_tree",),
    "active_url_from_accessTree": ("accessibility_tree",),
    "bookmarks": _CHROME_FILE,
    "chrome_font_size": _CHROME_FILE,
    "chrome_language": _CHROME_FILE,
    "cookie_data": _CHROME_FILE,
    "data_delete_automacally": _CHROME_FILE,
    "default_search_engine": _CHROME_FILE,
    "enable_do_not_track": _CHROME_FILE,
    "enable_enhanced_safety_browsing": _CHROME_FILE,
    "enable_safe_browsing": _CHROME_FILE,
    "enabled_experiments": _CHROME_FILE,
    "find_installed_extension_name": _CHROME_FILE,
    "find_unpacked_extension_path": _CHROME_FILE,
    "gimp_config_file": ("app:gimp",),
    "googledrive_file": ("google_drive", "worker_internet"),
    "gotoRecreationPage_and_get_html_content": ("chrome_cdp", "internet", "worker_internet"),
    "history": _CHROME_FILE,
    "info_from_website": ("chrome_cdp", "internet"),
    "macys_product_url_parse": ("accessibility_tree",),
    "new_startup_page": _CHROME_FILE,
    "number_of_search_results": ("chrome_cdp", "internet"),
    "open_tabs_info": ("chrome_cdp",),
    "page_info": ("chrome_cdp", "internet"),
    "pdf_from_url": ("chrome_cdp", "internet"),
    "profile_name": _CHROME_FILE,
    "url_dashPart": ("accessibility_tree",),
    "url_path_parse": ("accessibility_tree",),
    "vlc_config": ("app:vlc",),
    "vlc_playing_info": ("vlc_http",),
    "vscode_config": ("app:vscode",),
}
SETUP_NEEDS: dict[str, tuple[str, ...]] = {
    "chrome_close_tabs": ("chrome_cdp",),
    "chrome_open_tabs": ("chrome_cdp",),  # and internet when a tab is a public site
    "googledrive": ("google_drive", "worker_internet"),
    "login": ("chrome_cdp", "internet", "google_drive"),
    "proxy": ("internet",),
    "update_browse_history": ("app:chrome", "worker_internet"),
}
# A launched program's name -> the app it is.
PROGRAMS = {
    "google-chrome": "chrome",
    "chromium": "chrome",
    "code": "vscode",
    "thunderbird": "thunderbird",
    "gimp": "gimp",
    "vlc": "vlc",
    "libreoffice": "libreoffice",
    "soffice": "libreoffice",
    "nautilus": "nautilus",
}
# A task's related_apps entry (OSWorld spells them several ways) -> the app.
RELATED_APPS = {
    "chrome": "chrome",
    "chromium": "chrome",
    "google chrome": "chrome",
    "browser": "chrome",
    "gimp": "gimp",
    "vlc": "vlc",
    "thunderbird": "thunderbird",
    "vscode": "vscode",
    "vs_code": "vscode",
    "libreoffice": "libreoffice",
    "calc": "libreoffice",
    "writer": "libreoffice",
    "impress": "libreoffice",
}
# A file a setup step `open`s, by extension -> the app that opens it.
OPENED_BY = {
    **dict.fromkeys(
        (".xlsx", ".xls", ".ods", ".csv", ".docx", ".doc", ".odt", ".pptx", ".ppt", ".odp"),
        "libreoffice",
    ),
    **dict.fromkeys((".mp4", ".mp3", ".wav", ".avi", ".mkv", ".webm"), "vlc"),
    ".xcf": "gimp",
}
LOCAL_HOSTS = ("localhost", "127.0.0.1", "")


def _related_app(name: str) -> str | None:
    key = name.strip().lower()
    if key in RELATED_APPS:
        return RELATED_APPS[key]
    return "libreoffice" if key.startswith("libreoffice") else None


def _launched_app(command: Any) -> str | None:
    words = command.split() if isinstance(command, str) else command
    if not isinstance(words, list) or not words or not isinstance(words[0], str):
        return None
    return PROGRAMS.get(PurePosixPath(words[0]).name)


def _step_needs(step: dict[str, Any]) -> set[str]:
    kind, parameters = step.get("type"), step.get("parameters") or {}
    needs = set(SETUP_NEEDS.get(str(kind), ()))
    if kind == "launch" and (app := _launched_app(parameters.get("command"))):
        needs.add(f"app:{app}")
    if kind == "open" and isinstance(parameters.get("path"), str):
        app = OPENED_BY.get(PurePosixPath(parameters["path"]).suffix.lower())
        needs |= {f"app:{app}"} if app else set()
    if kind == "chrome_open_tabs":
        urls = parameters.get("urls_to_open") or []
        if any(urlparse(str(url)).hostname not in LOCAL_HOSTS for url in urls):
            needs.add("internet")
    return needs


def _getter_needs(getter: Any) -> set[str]:
    if not isinstance(getter, dict):
        return set()
    needs = set(GETTER_NEEDS.get(str(getter.get("type")), ()))
    if getter.get("type") == "rule_relativeTime":
        rules: dict[str, Any] = getter["rules"] if isinstance(getter.get("rules"), dict) else {}
        if "timezone" not in rules:
            needs.add("worker_internet")  # the getter asks ipapi.co for the timezone
    return needs


def task_needs(spec: dict[str, Any]) -> list[str]:
    """What an OSWorld task object needs of its slot (sorted; empty: any OSWorld desktop)."""
    evaluator: dict[str, Any] = spec["evaluator"] if isinstance(spec.get("evaluator"), dict) else {}
    needs: set[str] = set()
    for steps in (spec.get("config"), evaluator.get("postconfig")):
        for step in steps if isinstance(steps, list) else []:
            needs |= _step_needs(step) if isinstance(step, dict) else set()
    for key in ("result", "expected"):
        value = evaluator.get(key)
        for getter in value if isinstance(value, list) else [value]:
            needs |= _getter_needs(getter)
    for name in spec.get("related_apps") or []:
        if isinstance(name, str) and (app := _related_app(name)):
            needs.add(f"app:{app}")
    return sorted(needs)


def recorded_needs(env_config: dict[str, Any]) -> list[str]:
    """What an osworld task's env_config says it needs: recorded at import, computed from its
    task object for a task stored before imports recorded it."""
    if isinstance(env_config.get("needs"), list):
        return list(env_config["needs"])
    spec = env_config.get("osworld")
    return task_needs(spec) if isinstance(spec, dict) else []


def lacking(needs: list[str], offers: list[str] | tuple[str, ...]) -> list[str]:
    """The needs among `needs` that `offers` does not cover."""
    return [need for need in needs if need not in offers]
