"""The parts of OSWorld's `desktop-env` wheel Dartboard uses, imported without the rest.

The wheel (requirements-osworld.txt, installed with --no-deps) ships OSWorld's client: the
`PythonController` and `SetupController` that speak to the in-VM server, the evaluators'
metric and getter functions, and the VM providers. Its package `__init__`s import
everything: `desktop_env.evaluators.metrics` pulls in the GIMP, LibreOffice, PDF, VLC and
slides metrics (OpenCV, scikit-image, librosa, ...), `desktop_env.evaluators.getters` the
Chrome getters, none of which are installed here. `desktop_env/__init__.py`,
`controllers/__init__.py` and `evaluators/__init__.py` are empty.

So `wheel()` registers those two packages in `sys.modules` as bare packages (a module whose
`__path__` is the package directory, as Python's import system would make it, minus the
`__init__` code) and then imports only the submodules listed in METRIC_MODULES and
GETTER_MODULES with the normal import machinery. Their own imports (requests, lxml, pandas,
formulas, openpyxl, ...) are installed and pinned in requirements.lock. A metric or getter
from any other submodule is "not available here", and the task importer says so by name.
Nothing is re-implemented: every function called is the wheel's.

The metrics run outside any sandbox, on files the agent wrote (a getter fetches them from
the desktop), each call in a child process of the env worker under memory, CPU and time
limits (envmanager.osworld_metric_process). So only the metrics read line by line and
found to be pure data comparisons (SAFE_METRICS: they compare values, or read the fetched
files with data-only parsers, and write, import and run nothing) are callable through
`wheel().metrics`. The ones read and refused are in REFUSED_METRICS with the reason, and
any other function those modules define (a newer wheel's) is refused as not reviewed: the
task importer names the metric and why, and the evaluator refuses it again at run time.
Getters write what they fetch under the evaluator's cache directory at a name the task
gives (`dest`), and so do the execute setup steps (`stdout`): `getter_refusal` and
`setup_step_refusal` refuse a name that is a path (see GETTER_CACHE_NAMES).

Importing `controllers.setup` runs two side effects of the wheel's own: `dotenv.load_dotenv()`
(a .env next to the installed package or above it) and the AWS proxy pool's init (it logs
that evaluation_examples/settings/proxy/dataimpulse.json is missing). Both happen on the
first `wheel()` call, never at Dartboard's import time.

    .venv/bin/python -c "from envmanager.osworld_wheel import wheel; print(sorted(wheel().metrics)[:5])"
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

METRIC_MODULES = ("general", "vscode")  # desktop_env.evaluators.metrics.<name>
GETTER_MODULES = ("file", "general", "misc", "info")  # desktop_env.evaluators.getters.<name>
INFEASIBLE = "infeasible"  # OSWorld's evaluator func for tasks the agent must refuse

# Read in desktop-env 1.0.2: each compares values, or opens the files a getter fetched with
# data-only parsers (open/read, json, yaml.safe_load, csv, re, rapidfuzz, lxml 6 without
# external entities, python-docx, pdfplumber, BeautifulSoup), and writes, imports and runs
# nothing.
SAFE_METRICS = frozenset(
    {
        # metrics.general
        "check_accessibility_tree",
        "check_csv",
        "check_direct_json_object",
        "check_include_exclude",
        "check_json",
        "check_line_number",
        "check_list",
        "compare_python_pure_text",
        "compare_terminal_and_txt",
        "compare_time_in_speedtest_results",
        "diff_text_file",
        "exact_match",
        "file_contains",
        "fuzzy_match",
        "fuzzy_place_math",
        "is_gold_text_included_in_pdf",
        "is_in_list",
        "is_included_all_json_objects",
        "literal_match",
        "match_in_list",
        # metrics.vscode
        "check_html_background_image",
        "check_json_keybindings",
        "check_json_settings",
        "compare_answer",
        "compare_config",
        "compare_result_files",
        "compare_text_file",
        "is_extension_installed",
    }
)
# Read in desktop-env 1.0.2 and refused: what each would do in the env worker, unsandboxed.
REFUSED_METRICS = {
    "check_python_file_by_test_suite": (
        "it imports a Python test file with exec_module and calls its test function in the "
        "env worker, outside the sandbox, with the test file's directory (where the agent's "
        "files are) put first on sys.path: the agent's code would run on the host"
    ),
    "run_sqlite3": (
        "it opens a database file the agent wrote and runs the task's SQL on it in the env "
        "worker, outside the sandbox: the agent's views and triggers run inside that query, "
        "with no time limit"
    ),
    "compare_zip_files": (
        "it unpacks the agent's zip file whole in the env worker's memory and writes each PDF "
        "in it to temp.pdf in the env worker's working directory (see compare_pdf_content)"
    ),
    "compare_pdf_content": (
        "it writes the agent's PDF bytes to temp.pdf in the env worker's working directory, "
        "a host file outside the sandbox shared by every evaluation"
    ),
    "check_python_file_by_gold_file": (
        "its body is `pass` in desktop-env 1.0.2: it scores nothing (every call would fail)"
    ),
}
NOT_REVIEWED = (
    "it is not among the metrics read as pure data comparisons "
    "(envmanager.osworld_wheel.SAFE_METRICS); metrics run in the env worker, outside the sandbox"
)
# Files the wheel opens at os.path.join(<the evaluator's cache directory>, <a name the task
# gives>), where an absolute name or one with '..' is any host file: the getters vm_file,
# cloud_file and vm_wallpaper write what they fetched at `dest`, cache_file reads `path`; the
# setup steps execute and command write the command's output at `stdout`/`stderr` (in
# postconfig, after the agent acted).
GETTER_CACHE_NAMES = {"dest": "writes the fetched file to", "path": "reads"}
SETUP_CACHE_NAMES = ("stdout", "stderr")


class WheelUnavailable(RuntimeError):
    """desktop-env is not installed (or a module it needs is missing)."""


@dataclass(frozen=True)
class Wheel:
    python_controller: type  # desktop_env.controllers.python.PythonController
    setup_controller: type  # desktop_env.controllers.setup.SetupController
    metrics: dict[str, Callable[..., Any]]  # func name -> metric function (SAFE_METRICS only)
    refused_metrics: dict[str, str]  # func name -> why it does not run here
    getters: dict[str, Callable[..., Any]]  # getter type ("vm_file") -> get_vm_file
    setup_types: frozenset[str]  # config step types SetupController has a _<type>_setup for
    keyboard_keys: frozenset[str]  # pyautogui key names OSWorld accepts


def _bare_package(name: str) -> None:
    """Put package `name` in sys.modules without running its __init__ (see the docstring)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise WheelUnavailable(f"{name} is not an installed package")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__package__ = name
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)


def metric_refusal(name: str) -> str | None:
    """Why metric `name` of the wheel's modules may not run here; None for a SAFE_METRICS one."""
    if name in SAFE_METRICS:
        return None
    return REFUSED_METRICS.get(name, NOT_REVIEWED)


def _cache_name_refusal(key: str, value: Any, action: str) -> str | None:
    for name in value if isinstance(value, list) else [value]:
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name:
            return (
                f"{key} {name!r} must be a file name (no '/', not '.' or '..'): it "
                f"{action} os.path.join(<the evaluator's cache directory>, {key}), "
                "a host file outside the sandbox"
            )
    return None


def getter_refusal(config: dict[str, Any]) -> str | None:
    """Why a getter config may not run (a cache file name that is a path); None if it may."""
    for key, action in GETTER_CACHE_NAMES.items():
        if key in config and (key == "dest" or config.get("type") == "cache_file"):
            why = _cache_name_refusal(key, config[key], f"{config.get('type')} {action}")
            if why:
                return why
    return None


def setup_step_refusal(parameters: dict[str, Any]) -> str | None:
    """Why an execute/command setup step's parameters may not run; None if they may."""
    for key in SETUP_CACHE_NAMES:
        if parameters.get(key):  # "" (the default) writes nothing
            why = _cache_name_refusal(key, parameters[key], "writes the command's output to")
            if why:
                return why
    return None


def _public_functions(module: types.ModuleType, prefix: str = "") -> dict[str, Callable]:
    return {
        name.removeprefix(prefix): fn
        for name, fn in vars(module).items()
        if inspect.isfunction(fn)
        and fn.__module__ == module.__name__
        and name.startswith(prefix)
        and not name.startswith("_")
    }


@lru_cache(maxsize=1)
def wheel() -> Wheel:
    """Import the controllers, metrics and getters Dartboard uses (once per process)."""
    try:
        importlib.import_module("desktop_env.evaluators")
        _bare_package("desktop_env.evaluators.metrics")
        _bare_package("desktop_env.evaluators.getters")
        python = importlib.import_module("desktop_env.controllers.python")
        setup = importlib.import_module("desktop_env.controllers.setup")
        actions = importlib.import_module("desktop_env.actions")
        metrics: dict[str, Callable] = {}
        for name in METRIC_MODULES:
            metrics |= _public_functions(
                importlib.import_module(f"desktop_env.evaluators.metrics.{name}")
            )
        getters: dict[str, Callable] = {}
        for name in GETTER_MODULES:
            getters |= _public_functions(
                importlib.import_module(f"desktop_env.evaluators.getters.{name}"), "get_"
            )
    except ImportError as exc:
        raise WheelUnavailable(
            f"OSWorld's desktop-env cannot be imported ({exc}): `make install` installs it "
            "(requirements-osworld.txt with --no-deps, its needs from requirements.lock)"
        ) from exc
    controller = setup.SetupController
    setup_types = frozenset(
        name[1 : -len("_setup")]
        for name in dir(controller)
        if name.startswith("_") and name.endswith("_setup") and not name.startswith("__")
    )
    refused = {name: why for name in metrics if (why := metric_refusal(name))}
    return Wheel(
        python_controller=python.PythonController,
        setup_controller=controller,
        metrics={name: fn for name, fn in metrics.items() if name not in refused},
        refused_metrics=refused,
        getters=getters,
        setup_types=setup_types,
        keyboard_keys=frozenset(actions.KEYBOARD_KEYS),
    )
