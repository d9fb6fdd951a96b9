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


class WheelUnavailable(RuntimeError):
    """desktop-env is not installed (or a module it needs is missing)."""


@dataclass(frozen=True)
class Wheel:
    python_controller: type  # desktop_env.controllers.python.PythonController
    setup_controller: type  # desktop_env.controllers.setup.SetupController
    metrics: dict[str, Callable[..., Any]]  # func name -> metric function
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
    return Wheel(
        python_controller=python.PythonController,
        setup_controller=controller,
        metrics=metrics,
        getters=getters,
        setup_types=setup_types,
        keyboard_keys=frozenset(actions.KEYBOARD_KEYS),
    )
