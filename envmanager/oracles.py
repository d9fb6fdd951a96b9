"""Scripted solvers that reach reward 1, used to pre-collect demos for the experience pool.

`oracle_action(env_kind=..., task_name=..., observation=...)` returns the next `Action` a
perfect agent would take, the same `Action` objects a model's parsed output becomes, or None
when the episode is over (or the task has no oracle). It is stateless: MiniWoB oracles read
the DOM elements and fields in `observation.metadata` (so a half-done form is completed from
where it stands); desktop oracles replay their task's fixed plan indexed by
`observation.metadata["step"]` (desktop tasks launch their windows at fixed geometry), and
so do the OSWorld-format tasks of tasks/osworld/ (envmanager/osworld_oracles.py).

    obs = env.reset(task)
    while (action := oracle_action(env_kind=env.kind, task_name=task.name, observation=obs)):
        obs = env.step(action)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.protocol import Action, ActionType, Observation
from envmanager.desktop_tasks import DESKTOP_TASKS, desktop_oracle_plan
from envmanager.osworld_oracles import OSWORLD_PLANS

Element = dict[str, Any]

# CSS named colours used by click-color / click-color-2, as RGB floats in [0, 1].
CSS_COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "olive": (0.5, 0.5, 0.0),
    "lime": (0.0, 1.0, 0.0),
    "black": (0.0, 0.0, 0.0),
    "white": (1.0, 1.0, 1.0),
    "grey": (0.5, 0.5, 0.5),
    "gray": (0.5, 0.5, 0.5),
    "purple": (0.5, 0.0, 0.5),
    "orange": (1.0, 0.65, 0.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "pink": (1.0, 0.75, 0.8),
    "magenta": (1.0, 0.0, 1.0),
}


# ------------------------------------------------------------------ DOM helpers


def _click(element: Element) -> Action:
    """A click at the element's centre (DOM coordinates are MiniWoB screen pixels)."""
    x = int(element["left"] + element["width"] / 2)
    y = int(element["top"] + element["height"] / 2)
    return Action(type=ActionType.CLICK, x=x, y=y)


def _find(elements: list[Element], predicate: Callable[[Element], bool]) -> Element | None:
    return next((e for e in elements if predicate(e)), None)


def _label_text(elements: list[Element], element: Element) -> str:
    """Text of the <t> siblings next to an input inside a <label>."""
    texts = [
        e["text"]
        for e in elements
        if e["parent_ref"] == element["parent_ref"] and e["tag"] == "t" and e["text"]
    ]
    return " ".join(texts).strip()


def _button(elements: list[Element], text: str) -> Element | None:
    return _find(elements, lambda e: e["tag"] == "button" and (e["text"] or "").strip() == text)


def _fill(elements: list[Element], field: Element, value: str) -> Action | None:
    """Focus `field` then type `value`; None once it holds `value`."""
    if field["value"] == value:
        return None
    if not field["focused"]:
        return _click(field)
    current = field["value"] or ""
    if value.startswith(current):
        return Action(type=ActionType.TYPE, text=value[len(current) :])
    return Action(type=ActionType.HOTKEY, key="backspace")  # the caret ends after typed text


def _fill_then_submit(
    elements: list[Element], pairs: list[tuple[Element | None, str]], submit: str
) -> Action | None:
    for field, value in pairs:
        if field is None:
            return None
        action = _fill(elements, field, value)
        if action is not None:
            return action
    button = _button(elements, submit)
    return _click(button) if button else None


# ------------------------------------------------------------------ MiniWoB oracles


def _click_test(els: list[Element], fields: dict[str, str]) -> Action | None:
    button = _find(els, lambda e: e["tag"] == "button")
    return _click(button) if button else None


def _click_button_by_text(els: list[Element], fields: dict[str, str]) -> Action | None:
    button = _button(els, fields.get("target", ""))
    return _click(button) if button else None


def _click_link(els: list[Element], fields: dict[str, str]) -> Action | None:
    link = _find(els, lambda e: "alink" in e["classes"] and e["text"] == fields.get("target"))
    return _click(link) if link else None


def _focus_text(els: list[Element], fields: dict[str, str]) -> Action | None:
    inputs = [e for e in els if e["tag"] == "input_text"]
    index = int(fields.get("target", "1")) - 1
    return _click(inputs[index]) if 0 <= index < len(inputs) else None


def _click_dialog(els: list[Element], fields: dict[str, str]) -> Action | None:
    target = fields.get("target", "x")
    if target == "x":
        button = _find(els, lambda e: "ui-dialog-titlebar-close" in e["classes"])
    else:
        button = _button(els, target)
    return _click(button) if button else None


def _click_color(els: list[Element], fields: dict[str, str]) -> Action | None:
    want = CSS_COLORS.get(fields.get("target", ""))
    boxes = [e for e in els if "color" in e["classes"].split()]
    if want is None or not boxes:
        return None

    def distance(box: Element) -> float:
        return sum((a - b) ** 2 for a, b in zip(box["bg_color"][:3], want, strict=True))

    return _click(min(boxes, key=distance))


def _click_tab(els: list[Element], fields: dict[str, str]) -> Action | None:
    tab = _find(els, lambda e: e["tag"] == "a" and e["text"] == f"Tab #{fields.get('target')}")
    return _click(tab) if tab else None


def _choose_inputs(els: list[Element], fields: dict[str, str], tag: str) -> Action | None:
    """click-checkboxes / click-option: make the ticked set equal the targets, then Submit."""
    targets = {v for k, v in fields.items() if k.startswith("target")}
    for box in (e for e in els if e["tag"] == tag):
        if bool(box["value"]) != (_label_text(els, box) in targets):
            return _click(box)
    button = _button(els, "Submit")
    return _click(button) if button else None


def _enter_text(els: list[Element], fields: dict[str, str]) -> Action | None:
    field = _find(els, lambda e: e["tag"] == "input_text")
    return _fill_then_submit(els, [(field, fields.get("target", ""))], "Submit")


def _enter_password(els: list[Element], fields: dict[str, str]) -> Action | None:
    pw = fields.get("target", "")
    first = _find(els, lambda e: e["id"] == "password")
    second = _find(els, lambda e: e["id"] == "verify")
    return _fill_then_submit(els, [(first, pw), (second, pw)], "Submit")


def _login_user(els: list[Element], fields: dict[str, str]) -> Action | None:
    user = _find(els, lambda e: e["id"] == "username")
    pw = _find(els, lambda e: e["id"] == "password")
    return _fill_then_submit(
        els, [(user, fields.get("username", "")), (pw, fields.get("password", ""))], "Login"
    )


MINIWOB_ORACLES: dict[str, Callable[[list[Element], dict[str, str]], Action | None]] = {
    "click-test": _click_test,
    "click-test-2": _click_button_by_text,
    "click-button": _click_button_by_text,
    "click-link": _click_link,
    "focus-text": _focus_text,
    "focus-text-2": _focus_text,
    "click-dialog": _click_dialog,
    "click-dialog-2": _click_dialog,
    "click-color": _click_color,
    "click-tab": _click_tab,
    "click-checkboxes": lambda els, f: _choose_inputs(els, f, "input_checkbox"),
    "click-option": lambda els, f: _choose_inputs(els, f, "input_radio"),
    "enter-text": _enter_text,
    "enter-password": _enter_password,
    "login-user": _login_user,
}


def miniwob_oracle_action(*, subdomain: str, observation: Observation) -> Action | None:
    """Next action for a MiniWoB task from the observation's DOM, or None when done/unknown."""
    meta = observation.metadata
    oracle = MINIWOB_ORACLES.get(subdomain)
    if oracle is None or meta.get("done"):
        return None
    return oracle(meta["dom_elements"], meta.get("fields", {}))


def oracle_action(*, env_kind: str, task_name: str, observation: Observation) -> Action | None:
    """The next scripted action for `task_name` (e.g. "miniwob/click-test", "desktop/...")."""
    if env_kind == "miniwob":
        subdomain = observation.metadata.get("task") or task_name.removeprefix("miniwob/")
        return miniwob_oracle_action(subdomain=subdomain, observation=observation)
    if env_kind == "desktop":
        plan = desktop_oracle_plan(name=task_name)
        step = int(observation.metadata.get("step", 0))
        return plan[step] if step < len(plan) else None
    if env_kind == "osworld":
        # envmanager/osworld_oracles.py: fixed plans of the tasks in tasks/osworld/.
        osworld_plan = OSWORLD_PLANS.get(task_name, ())
        step = int(observation.metadata.get("step", 0))
        return osworld_plan[step] if step < len(osworld_plan) else None
    if env_kind == "sim":
        # envmanager/sim_env.py: the next box to click is on the screen's metadata.
        boxes, nxt = observation.metadata["targets"], int(observation.metadata["next"])
        if nxt >= len(boxes):
            return None
        left, top, right, bottom = boxes[nxt]
        return Action(type=ActionType.CLICK, x=(left + right) // 2, y=(top + bottom) // 2)
    raise ValueError(f"no oracle for env kind {env_kind!r}")


def has_oracle(*, env_kind: str, task_name: str) -> bool:
    """Whether `oracle_action` can solve this task (for demo pre-collection)."""
    if env_kind == "miniwob":
        return task_name.removeprefix("miniwob/") in MINIWOB_ORACLES
    if env_kind == "desktop":
        return task_name in DESKTOP_TASKS
    if env_kind == "osworld":
        return task_name in OSWORLD_PLANS
    return env_kind == "sim"
