"""The `osworld` backend: an OSWorld VM (or a Dartboard desktop serving OSWorld's protocol,
envmanager.osworld_server) driven by address with OSWorld's own client from the wheel.

One env holds one VM address ("host:port"). Per episode:

- reset: empty the env's cache directory (the wheel's getters and downloads use it), put in
  it the task's own files and every file it fetches by URL, from this host's file cache
  (envmanager.osworld_file_cache: a task whose files the cache lacks is refused here, naming
  the URLs, and nothing opens the internet); bring the VM back to a clean state, by the provider's snapshot revert where one is
  configured (`Provider`: desktop_env's vmware / virtualbox / docker / aws / azure / aliyun /
  volcengine, the VM's path or id and the snapshot name; not tested here: no VM image can
  be fetched), else by a Dartboard desktop's `POST /dartboard/reset`; a VM with neither is
  refused with that reason. Then the health check (/screen_size answers), then the task's
  `config` steps through the wheel's `SetupController`.
- step: the Action as pyautogui code (envmanager.osworld_actions), scaled from screenshot
  pixels to the VM's /screen_size, run by the wheel's
  `PythonController.execute_python_command` (the VM's /execute); then a screenshot.
- evaluate: the task's `evaluator` with the wheel's getters and metrics
  (envmanager.osworld_evaluator); a failing evaluator raises EnvUnavailable with its reason.

The desktop's token (its own: `rollout.auth.desktop_purpose`, derived by the workers) rides
in the address's userinfo (`dartboard:<token>@host`), which `requests` sends as HTTP Basic
auth, so the wheel's client needs no change; an OSWorld VM's own server ignores it. The
wheel's controllers have no header option and log that URL (`SetupController`: "try to
connect http://dartboard:<token>@..." at INFO), so every `desktopenv.*` logger carries
`RedactCredentials`, which writes the password of any URL as `***`, and so do this module's
own error messages. The controllers' retries are shortened (3 tries 5 s apart in the
wheel): a missing file is an answer, and a dead VM should end the episode in seconds.

    env = OSWorldEnv(address="127.0.0.1:5000", token=desktop_token)
    obs = env.reset(TaskSpec("osworld/x", "osworld", {"osworld": json.load(open(path))}))
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from PIL import Image

from core.protocol import (
    Action,
    ActionType,
    EnvUnavailable,
    Evaluation,
    Observation,
    TaskSpec,
)
from core.redact import redact_credentials
from envmanager.osworld_actions import pyautogui_command
from envmanager.osworld_evaluator import WheelEnv, evaluate_task
from envmanager.osworld_file_cache import (
    CacheError,
    FileCache,
    clear_directory,
    place_task_files,
    task_urls,
)
from envmanager.osworld_needs import lacking, recorded_needs
from envmanager.osworld_task_files import steps_with_task_files
from envmanager.osworld_wheel import wheel

HEALTH_TIMEOUT_S = 5.0
CONTROLLER_RETRIES, CONTROLLER_RETRY_S = 2, 0.3


WHEEL_LOGGERS = "desktopenv"  # the wheel's loggers: desktopenv.setup, desktopenv.pycontroller, ...


class RedactCredentials(logging.Filter):
    """Rewrites a record's message with URL passwords redacted (before any handler sees it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_credentials(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def redact_wheel_logs() -> None:
    """Put RedactCredentials on every `desktopenv.*` logger (a logger's filters see only the
    records logged to it, not its children's, so each gets one). Idempotent; call it after
    `wheel()` has imported the modules that create them."""
    for name, logger in list(logging.root.manager.loggerDict.items()):
        ours = name == WHEEL_LOGGERS or name.startswith(WHEEL_LOGGERS + ".")
        if not ours or not isinstance(logger, logging.Logger):
            continue
        if not any(isinstance(f, RedactCredentials) for f in logger.filters):
            logger.addFilter(RedactCredentials())


class AddressError(ValueError):
    """A VM address that is not host:port."""


def parse_address(address: str) -> tuple[str, int]:
    """'10.0.0.5:5000' -> ('10.0.0.5', 5000); AddressError with the reason otherwise."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressError(f"{address!r} is not host:port (e.g. 10.0.0.5:5000)")
    if "@" in host or "/" in host:
        raise AddressError(f"{address!r}: give host:port only (the token comes from settings)")
    return host, int(port)


@dataclass(frozen=True)
class Provider:
    """How to revert a VM: desktop_env's provider name, the VM's path or id there, the
    snapshot, and the provider's region (cloud providers)."""

    name: str
    vm_path: str
    snapshot: str = "init_state"
    region: str = ""


class OSWorldEnv:
    """One OSWorld-protocol VM by address; implements `Env`."""

    kind = "osworld"

    def __init__(
        self,
        *,
        address: str,
        token: str = "",
        provider: Provider | None = None,
        settle_s: float = 0.3,
        wait_seconds: float = 1.0,
        file_cache: FileCache | None = None,
    ) -> None:
        """`file_cache`: where the files tasks fetch by URL come from (none: a task that
        fetches one is refused)."""
        self.address = address
        self.host, self.port = parse_address(address)
        self.provider = provider
        self.settle_s = settle_s
        self.wait_seconds = wait_seconds
        self.file_cache = file_cache
        self._offers: list[str] | None = None  # a Dartboard desktop's, asked once
        self._vouched = False  # an OSWorld VM: the run's osworld_offers vouch for it
        self._auth = ("dartboard", token) if token else None
        self._vm_ip = f"dartboard:{token}@{self.host}" if token else self.host
        self._cache = tempfile.mkdtemp(prefix="dartboard-osworld-cache-")
        w = wheel()
        redact_wheel_logs()
        self._keys = w.keyboard_keys
        self.controller = w.python_controller(self._vm_ip, self.port)
        self.controller.retry_times = CONTROLLER_RETRIES
        self.controller.retry_interval = CONTROLLER_RETRY_S
        self._spec: dict[str, Any] | None = None
        self._task_name: str | None = None
        self._instruction = ""
        self._screen = (0, 0)
        self._scale = (1.0, 1.0)
        self._last: ActionType | None = None
        self._step = 0

    # ---------------------------------------------------------------- Env protocol

    def reset(self, task: TaskSpec) -> Observation:
        spec = task.env_config.get("osworld")
        if not isinstance(spec, dict):
            raise ValueError(f"{task.name}: env_config has no 'osworld' task object")
        clear_directory(Path(self._cache))  # the last task's files and what it fetched
        spec = self._with_task_files(spec, task)
        self._place_url_files(spec, task)
        self._restore()
        self._check_offers(task, spec)
        width, height = self._screen = self.screen_size()
        setup = self._setup_controller()
        try:
            setup.setup(spec.get("config") or [])
        except Exception as exc:
            raise EnvUnavailable(
                f"osworld {self.address}: setup of {task.name} failed: "
                + redact_credentials(str(exc))
            ) from exc
        self._spec, self._task_name = spec, task.name
        self._instruction = task.instruction or spec.get("instruction", "")
        self._last, self._step = None, 0
        obs = self._observe()
        self._scale = (width / obs.width, height / obs.height)
        return obs

    def step(self, action: Action) -> Observation:
        if self._spec is None:
            raise RuntimeError("OSWorldEnv.step before reset")
        code = pyautogui_command(action, scale=self._scale, keys=self._keys)
        if code is not None:
            answer = self.controller.execute_python_command(code)
            if answer is None:
                raise EnvUnavailable(f"osworld {self.address}: /execute did not answer")
            if answer.get("returncode") != 0:
                detail = (answer.get("error") or "").strip().splitlines()
                raise EnvUnavailable(
                    f"osworld {self.address}: pyautogui failed: {detail[-1] if detail else answer}"
                )
        if action.type == ActionType.WAIT:
            time.sleep(self.wait_seconds)
        time.sleep(self.settle_s)
        self._last = action.type
        self._step += 1
        return self._observe()

    def evaluate(self, *, ended_by: ActionType | None = None) -> Evaluation:
        """`ended_by`: how the policy ended the episode (the runner does not step finished or
        call_user); a driver that stepped them itself leaves it out."""
        if self._spec is None:
            return Evaluation(reward=0.0, success=False, details={"reason": "no task was reset"})
        env = WheelEnv(
            vm_ip=self._vm_ip,
            server_port=self.port,
            controller=self.controller,
            setup_controller=self._setup_controller(),
            cache_dir=self._cache,
        )
        return evaluate_task(self._spec["evaluator"], env=env, last_action=ended_by or self._last)

    def close(self) -> None:
        self._spec = None
        shutil.rmtree(self._cache, ignore_errors=True)

    # ---------------------------------------------------------------- the VM

    def screen_size(self) -> tuple[int, int]:
        """The health check: /screen_size answers with the VM's screen in pixels."""
        try:
            answer = requests.post(
                f"http://{self.host}:{self.port}/screen_size",
                auth=self._auth,
                timeout=HEALTH_TIMEOUT_S,
            )
            answer.raise_for_status()
            size = answer.json()
            return int(size["width"]), int(size["height"])
        except (requests.RequestException, ValueError, KeyError) as exc:
            raise EnvUnavailable(f"osworld {self.address}: health check failed: {exc}") from exc

    def _restore(self) -> None:
        if self.provider is not None:
            self._revert_snapshot(self.provider)
            return
        try:
            answer = requests.post(
                f"http://{self.host}:{self.port}/dartboard/reset", auth=self._auth, timeout=30
            )
        except requests.RequestException as exc:
            raise EnvUnavailable(f"osworld {self.address}: unreachable: {exc}") from exc
        if answer.status_code == 404:
            raise EnvUnavailable(
                f"osworld {self.address} cannot be reset: configure a provider (snapshot "
                "revert) for it, or serve a Dartboard desktop there"
            )
        if answer.status_code != 200:
            raise EnvUnavailable(
                f"osworld {self.address}: reset answered {answer.status_code}: {answer.text[:200]}"
            )

    def _revert_snapshot(self, provider: Provider) -> None:
        """desktop_env's provider reverts the VM (untested here: no VM image can be had)."""
        try:
            # Imported here for start-up cost: each provider pulls in its cloud SDK.
            from desktop_env.providers import create_vm_manager_and_provider

            _, vm = create_vm_manager_and_provider(provider.name, provider.region)
            vm.revert_to_snapshot(provider.vm_path, provider.snapshot)
        except Exception as exc:
            raise EnvUnavailable(
                f"osworld {self.address}: {provider.name} snapshot revert of "
                f"{provider.vm_path} to {provider.snapshot!r} failed: {exc}"
            ) from exc
        deadline = time.monotonic() + 300
        while True:  # the VM's server comes back after the revert
            with contextlib.suppress(EnvUnavailable):
                self.screen_size()
                return
            if time.monotonic() > deadline:
                raise EnvUnavailable(f"osworld {self.address}: no answer 300 s after a revert")
            time.sleep(2.0)

    def _with_task_files(self, spec: dict[str, Any], task: TaskSpec) -> dict[str, Any]:
        """The task with its setup steps reading the files it carries from this env's
        private cache, never a host path (`envmanager.osworld_task_files`)."""
        files = task.env_config.get("files") or {}
        into = Path(self._cache) / "task-files"  # emptied with the cache at reset
        spec = dict(spec)
        try:
            spec["config"] = steps_with_task_files(spec.get("config") or [], files, into)
            evaluator = spec.get("evaluator")
            if isinstance(evaluator, dict) and evaluator.get("postconfig"):
                spec["evaluator"] = {
                    **evaluator,
                    "postconfig": steps_with_task_files(
                        evaluator["postconfig"], files, into, field="evaluator.postconfig"
                    ),
                }
        except ValueError as exc:
            raise ValueError(f"{task.name}: {exc}") from None
        return spec

    def _check_offers(self, task: TaskSpec, spec: dict[str, Any]) -> None:
        """A Dartboard desktop says what it offers (`GET /dartboard/offers`); a task that
        needs more is refused before its setup runs. An OSWorld VM has no such route: the
        run's `env.osworld_offers` vouches for it."""
        if self._offers is None:
            try:
                answer = requests.get(
                    f"http://{self.host}:{self.port}/dartboard/offers",
                    auth=self._auth,
                    timeout=HEALTH_TIMEOUT_S,
                )
            except requests.RequestException as exc:
                raise EnvUnavailable(f"osworld {self.address}: unreachable: {exc}") from exc
            if answer.status_code not in (200, 404):  # a wrong token, a failing server
                raise EnvUnavailable(
                    f"osworld {self.address}: /dartboard/offers answered "
                    f"{answer.status_code}: {answer.text[:200]}"
                )
            self._vouched = answer.status_code == 404  # OSWorld's own server has no route
            self._offers = [] if self._vouched else answer.json()["offers"]
        if self._vouched:
            return
        lacks = lacking(recorded_needs(task.env_config), self._offers)
        if lacks:
            offered = ", ".join(self._offers) or "no application"
            raise EnvUnavailable(
                f"osworld {self.address}: {task.name} needs {', '.join(lacks)}, which this "
                f"desktop does not offer (it offers {offered}; `make desktop-apps` installs "
                "the applications)"
            )

    def _place_url_files(self, spec: dict[str, Any], task: TaskSpec) -> None:
        """Every file the task fetches by URL, from the file cache into the wheel's cache
        directory, where its `download` step and `cloud_file` getter look first."""
        if not task_urls(spec):
            return
        if self.file_cache is None:
            raise EnvUnavailable(
                f"osworld {self.address}: {task.name} fetches files by URL, and this env "
                "has no file cache to take them from"
            )
        try:
            place_task_files(spec, self.file_cache, Path(self._cache))
        except CacheError as exc:
            raise EnvUnavailable(f"osworld {self.address}: {task.name}: {exc}") from exc

    def _setup_controller(self) -> Any:
        width, height = self._screen
        return wheel().setup_controller(
            vm_ip=self._vm_ip,
            server_port=self.port,
            cache_dir=self._cache,
            screen_width=width,
            screen_height=height,
        )

    def _observe(self) -> Observation:
        png = self.controller.get_screenshot()
        if png is None:
            raise EnvUnavailable(f"osworld {self.address}: /screenshot did not answer")
        try:
            width, height = Image.open(io.BytesIO(png)).size
        except OSError as exc:
            raise EnvUnavailable(f"osworld {self.address}: /screenshot is no image: {exc}") from exc
        return Observation(
            screenshot_png=png,
            width=width,
            height=height,
            instruction=self._instruction,
            metadata={
                "task": self._task_name,
                "step": self._step,
                "vm": self.address,
                "screen": list(self._screen),
            },
        )
