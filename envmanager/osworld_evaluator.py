"""An OSWorld task's `evaluator`, scored by the wheel's own getters and metrics.

OSWorld scores a task in `DesktopEnv.evaluate()`, a method of the class that boots a VM in
its constructor, so Dartboard cannot call it; `evaluate_task` follows it line by line
(postconfig steps; the "infeasible" func; a list of funcs joined by `conj` "and"/"or"; a
result getter's FileNotFoundError scores 0) and calls only the wheel's functions for the
work: `get_<type>(env, config)` for `result` and `expected`, then
`metric(result, expected, **options)`. `WheelEnv` is what those getters read off
DesktopEnv (vm_ip, server_port, controller, setup_controller, cache_dir, ...).

Infeasible tasks: success iff the episode's last action was `call_user` (OSWorld's FAIL;
envmanager.osworld_actions). On any other task, ending with call_user scores 0, as in
OSWorld.

Getters and postconfig steps run here, in the env worker (they talk to the VM); each metric
call runs in a child process of its own, outside the sandbox, under memory, CPU, wall-clock
and reply limits (envmanager.osworld_metric_process.MetricLimits), since it parses files
the agent made. A metric the wheel module defines but Dartboard refuses (one that would
import, run or write the agent's content on the host:
envmanager.osworld_metric_review), a getter or execute step whose cache file name is
a path, is refused before anything of the evaluator runs, as EnvUnavailable naming it and
why. The task importer refuses such a task first; this is the second line, for a task
stored before the refusal existed or written to the database by other means.

A metric past one of its limits (a docx zip bomb, a PDF of millions of drawing operators)
scores 0, and `details["reason"]` names the metric and the limit: the policy made that
file, so the episode is scored. A getter or metric that raises otherwise (the VM did not
answer, a malformed option) is not a score: `evaluate_task` raises EnvUnavailable naming
the func and the reason, and the episode ends as an environment error on its trajectory and
slot, never as reward 0. A MemoryError in the metric is its memory limit.

    evaluate_task(spec["evaluator"], env=wheel_env, last_action=ActionType.FINISHED)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.protocol import ActionType, EnvUnavailable, Evaluation
from envmanager.osworld_metric_process import (
    MetricFailed,
    MetricLimits,
    MetricOverLimit,
    metric_score,
)
from envmanager.osworld_metric_review import getter_review_refusal
from envmanager.osworld_wheel import INFEASIBLE, getter_refusal, setup_step_refusal, wheel


@dataclass
class WheelEnv:
    """The attributes of OSWorld's DesktopEnv that its getters and setup steps read."""

    vm_ip: str  # may carry userinfo ("dartboard:<token>@host"): requests sends it as auth
    server_port: int
    controller: Any  # desktop_env.controllers.python.PythonController
    setup_controller: Any  # desktop_env.controllers.setup.SetupController
    cache_dir: str
    chromium_port: int = 9222
    vlc_port: int = 8080
    vm_platform: str = "Linux"
    current_use_proxy: bool = False
    enable_proxy: bool = False


def _listify(value: Any, n: int) -> list[Any]:
    return value if isinstance(value, list) else [value] * n


def _refuse_unsafe(evaluator: dict[str, Any]) -> None:
    """Raise EnvUnavailable if any part of `evaluator` may not run in this process."""
    w = wheel()
    funcs = evaluator.get("func")
    for name in funcs if isinstance(funcs, list) else [funcs]:
        if name == INFEASIBLE:
            continue
        if name in w.refused_metrics:
            raise EnvUnavailable(
                f"osworld evaluator: metric {name!r} is refused: {w.refused_metrics[name]}"
            )
        if name not in w.metrics:
            raise EnvUnavailable(f"osworld evaluator: unknown metric func {name!r}")
    for key in ("result", "expected"):
        configs = evaluator.get(key)
        for config in configs if isinstance(configs, list) else [configs]:
            if not isinstance(config, dict):
                continue
            if why := getter_review_refusal(str(config.get("type"))) or getter_refusal(config):
                raise EnvUnavailable(f"osworld evaluator: {key} getter refused: {why}")
    for step in evaluator.get("postconfig") or []:
        if not isinstance(step, dict) or step.get("type") not in ("execute", "command"):
            continue
        parameters = step.get("parameters")
        if isinstance(parameters, dict) and (why := setup_step_refusal(parameters)):
            raise EnvUnavailable(f"osworld evaluator: postconfig step refused: {why}")


def evaluate_task(
    evaluator: dict[str, Any],
    *,
    env: WheelEnv,
    last_action: ActionType | None,
    limits: MetricLimits = MetricLimits(),
) -> Evaluation:
    """Score the VM's current state with the task's evaluator (see the module docstring).
    Each metric call runs in a process of its own under `limits`.

    Long because it follows OSWorld's evaluator in its order (postconfig, the agent's give-up,
    getters, metrics, their conjunction), each stage's failure named where it happens."""
    _refuse_unsafe(evaluator)
    postconfig = evaluator.get("postconfig") or []
    if postconfig:
        try:
            env.setup_controller.setup(postconfig)
        except Exception as exc:
            raise EnvUnavailable(f"osworld evaluator: postconfig failed: {exc}") from exc
    gave_up = last_action == ActionType.CALL_USER
    funcs = evaluator["func"]
    if funcs == INFEASIBLE:
        reward = 1.0 if gave_up else 0.0
        return Evaluation(reward, reward == 1.0, {"func": INFEASIBLE, "call_user": gave_up})
    if gave_up:
        return Evaluation(0.0, False, {"func": funcs, "reason": "call_user on a feasible task"})
    w = wheel()
    single = not isinstance(funcs, list)
    names: list[str] = [funcs] if single else funcs
    results = (
        _listify(evaluator.get("result"), len(names)) if not single else [evaluator.get("result")]
    )
    expected_all = evaluator.get("expected")
    expecteds = [expected_all] if single else _listify(expected_all, len(names))
    options_all = evaluator.get("options") or {}
    options = [options_all] if single else _listify(options_all, len(names))
    conj = evaluator.get("conj", "and")
    scores: list[float] = []
    shown: list[str] = []
    over_limit: list[str] = []
    for i, name in enumerate(names):
        getter: dict[str, Any] = results[i] or {}
        try:
            result = w.getters[getter["type"]](env, getter) if getter else None
        except FileNotFoundError:
            scores.append(0.0)
            shown.append("file not found")
            if conj == "and":
                break
            continue
        except Exception as exc:
            raise EnvUnavailable(
                f"osworld evaluator: {name}: result getter {getter.get('type')!r} "
                f"failed: {type(exc).__name__}: {exc}"
            ) from exc
        expected = expecteds[i]
        try:
            value = w.getters[expected["type"]](env, expected) if expected else None
        except Exception as exc:
            raise EnvUnavailable(
                f"osworld evaluator: {name} failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            score = metric_score(
                name,
                result,
                value,
                options=options[i] or {},
                has_expected=bool(expected),
                limits=limits,
            )
        except MetricOverLimit as exc:  # the agent's file did it: a score, not an outage
            score = 0.0
            over_limit.append(str(exc))
        except MetricFailed as exc:
            raise EnvUnavailable(f"osworld evaluator: {name} failed: {exc}") from exc
        scores.append(min(1.0, max(0.0, score)))
        shown.append(repr(result)[:200])
        if conj == "and" and score == 0.0:
            break
        if conj == "or" and score == 1.0:
            break
    if conj == "and":
        reward = 0.0 if 0.0 in scores else sum(scores) / len(scores)
    else:
        reward = max(scores)
    details: dict[str, Any] = {"func": funcs, "scores": scores, "results": shown}
    if over_limit:
        details["reason"] = "; ".join(over_limit)
    return Evaluation(reward=reward, success=reward >= 1.0, details=details)
