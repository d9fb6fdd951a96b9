"""The parts of OSWorld's `desktop-env` wheel Dartboard uses: its client controllers and
every getter and metric of its evaluators.

The wheel (requirements-osworld.txt, installed with --no-deps) ships OSWorld's client: the
`PythonController` and `SetupController` that speak to the in-VM server, the evaluators'
metric and getter functions, and the VM providers. `wheel()` loads every module of
`desktop_env.evaluators.metrics` and `getters`, and takes from each the names that package's
own `__init__` exports (read from its source: where two modules define a name, the later
import wins, as in the package), so a task names a metric or getter exactly as OSWorld
does. What those modules import (OpenCV, scikit-image, librosa, python-pptx, PyMuPDF,
odfpy, ...) is pinned in requirements.lock. The packages' `__init__` code itself is not
run: `_bare_package` registers each as a bare package (its directory as `__path__`) and the
modules are imported one by one with the normal import machinery, so that one module's
import (docs.py imports easyocr, which needs torchvision and downloads model weights on
first use; Dartboard installs neither) cannot take the others down: while easyocr is not
installed, `import easyocr` in docs.py binds a module that raises on first use, and the
one metric that uses it is refused by the review (envmanager.osworld_metric_review).
Nothing is re-implemented: every function called is the wheel's.

The metrics run outside the desktop's sandbox, on files the agent wrote (a getter fetches
them from the desktop), each call in a child process under memory, CPU, file-size and time
limits in a private scratch directory (envmanager.osworld_metric_process). Each exported
metric was read line by line and given a verdict (envmanager.osworld_metric_review): data
only, or writing only scratch files and running a fixed program, both callable through
`wheel().metrics`; or refused with the reason, in `wheel().refused_metrics`, which the task
importer names and the evaluator refuses again at run time. A name no review covers (a
newer wheel's) is refused as not reviewed.
Getters write what they fetch under the evaluator's cache directory at a name the task
gives (`dest`), and so do the execute setup steps (`stdout`): `getter_refusal` and
`setup_step_refusal` refuse a name that is a path (see GETTER_CACHE_NAMES).

Importing `controllers.setup` runs two side effects of the wheel's own: `dotenv.load_dotenv()`
(a .env next to the installed package or above it) and the AWS proxy pool's init (it logs
that evaluation_examples/settings/proxy/dataimpulse.json is missing). Both happen on the
first `wheel()` call, never at Dartboard's import time.

    .venv/bin/python -c "from envmanager.osworld_wheel import wheel; print(len(wheel().metrics))"
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from envmanager.osworld_metric_review import metric_refusal

METRICS = "desktop_env.evaluators.metrics"
GETTERS = "desktop_env.evaluators.getters"
INFEASIBLE = "infeasible"  # OSWorld's evaluator func for tasks the agent must refuse
# Modules a wheel module imports at its top that Dartboard does not install, with why: the
# name is bound to a module that raises on first use (`_absent_module`).
NOT_INSTALLED = {
    "easyocr": (
        "easyocr is not installed: it needs torchvision (no CPU build matches torch 2.13) "
        "and downloads its model weights from the internet on first use"
    ),
}
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
    metrics: dict[str, Callable[..., Any]]  # func name -> metric (the review's safe and scratch)
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
    time_format = config.get("time_format", "")
    if config.get("time_suffix") and (not isinstance(time_format, str) or "/" in time_format):
        return (  # vm_file puts the formatted time into its dest's file name
            f"time_format {time_format!r} must be a string without '/': vm_file puts the "
            "time it formats into the name of the file it writes in the cache directory"
        )
    return None


def setup_step_refusal(parameters: dict[str, Any]) -> str | None:
    """Why an execute/command setup step's parameters may not run; None if they may."""
    for key in SETUP_CACHE_NAMES:
        if parameters.get(key):  # "" (the default) writes nothing
            why = _cache_name_refusal(key, parameters[key], "writes the command's output to")
            if why:
                return why
    return None


class _AbsentModule(types.ModuleType):
    """Bound to a name a wheel module imports that is not installed: any use raises."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(name)
        self.__why = why

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):  # what tools probe modules for (__file__, __spec__, ...)
            raise AttributeError(attribute)
        raise ModuleNotFoundError(f"{self.__name__}.{attribute}: {self.__why}")


def _absent_module(name: str, why: str) -> None:
    if name not in sys.modules and importlib.util.find_spec(name) is None:
        sys.modules[name] = _AbsentModule(name, why)


def exported_names(package: str) -> dict[str, str]:
    """Name -> submodule for every `from .submodule import name` of `package`'s
    `__init__.py`, read from its source (the later import of a name wins, as when it runs)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise WheelUnavailable(f"{package} is not an installed package")
    names: dict[str, str] = {}
    for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
    return names


def _functions(package: str, prefix: str = "") -> dict[str, Callable[..., Any]]:
    """The functions `package` exports, by name less `prefix`, imported module by module."""
    functions = {}
    for name, module_name in exported_names(package).items():
        module = importlib.import_module(f"{package}.{module_name}")
        if name.startswith(prefix):
            functions[name.removeprefix(prefix)] = getattr(module, name)
    return functions


@lru_cache(maxsize=1)
def wheel() -> Wheel:
    """Import the controllers and every exported metric and getter (once per process)."""
    try:
        importlib.import_module("desktop_env.evaluators")
        _bare_package(METRICS)
        _bare_package(GETTERS)
        python = importlib.import_module("desktop_env.controllers.python")
        setup = importlib.import_module("desktop_env.controllers.setup")
        actions = importlib.import_module("desktop_env.actions")
        for module, reason in NOT_INSTALLED.items():
            _absent_module(module, reason)
        with warnings.catch_warnings():  # pdf.py's `import fitz`: PyMuPDF's old name warns
            warnings.filterwarnings("ignore", category=FutureWarning, module="fitz")
            metrics = _functions(METRICS)
            getters = _functions(GETTERS, "get_")
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
