"""Dartboard `Action`s as the pyautogui code an OSWorld VM runs through its /execute route.

OSWorld's `PythonController.execute_python_command(code)` runs
`python -c "import pyautogui; import time; pyautogui.FAILSAFE = False; <code>"` in the VM.
`pyautogui_command` builds that `<code>` from a structured Action: numbers formatted from
integers and text through `repr`, never spliced from model output, so the code is exactly
one pyautogui call (or a fixed pair for drag, or a fixed snippet that types text beyond ASCII).

Coordinates: an Action is in screenshot pixels (core.actions maps the model's image back to
the screenshot). pyautogui takes the VM's logical screen pixels (/screen_size); they differ
on a VM whose screenshot is scaled (HiDPI), so each point is multiplied by
`scale = screen size / screenshot size` and rounded.

How the episode-ending actions map to OSWorld's: `finished` is OSWorld's DONE and
`call_user` its FAIL (the agent says the task cannot be done), as UI-TARS-1.5's own OSWorld
agent maps them; an evaluator whose func is "infeasible" succeeds iff the episode ended
with call_user (envmanager.osworld_evaluator). `wait` sleeps on Dartboard's side (WAIT).

    .venv/bin/python -c "from envmanager.osworld_actions import pyautogui_command as c; \
        from core.protocol import Action; print(c(Action('click', 10, 20), scale=(2.0, 2.0), keys=frozenset()))"
"""

from __future__ import annotations

from core.protocol import Action, ActionNotSupported, ActionType, desktop_text

SCROLL_CLICKS = 5  # wheel clicks per UI-TARS scroll (pyautogui.scroll units on X11)
DRAG_SECONDS = 0.3

# Dartboard/UI-TARS key names -> pyautogui's (OSWorld's KEYBOARD_KEYS).
KEY_ALIASES = {
    "control": "ctrl",
    "return": "enter",
    "escape": "esc",
    "del": "delete",
    "arrowup": "up",
    "arrowdown": "down",
    "arrowleft": "left",
    "arrowright": "right",
    "meta": "win",
    "super": "win",
    "cmd": "command",
    "page_up": "pageup",
    "page_down": "pagedown",
    "space": "space",
}


def pyautogui_keys(key: str, *, keys: frozenset[str]) -> list[str]:
    """'ctrl shift t' -> ['ctrl', 'shift', 't']; ActionNotSupported for a key OSWorld's
    pyautogui does not know (`keys`: OSWorld's KEYBOARD_KEYS; empty accepts any)."""
    names = []
    for raw in key.replace("+", " ").split():
        name = KEY_ALIASES.get(raw.lower(), raw.lower())
        if keys and name not in keys:
            raise ActionNotSupported(f"hotkey {key!r}: pyautogui has no key {raw!r}")
        names.append(name)
    return names


def _type_any_script(text: str) -> str:
    """Code typing `text` with characters beyond ASCII: pyautogui types only what its
    keyboard map holds and silently skips the rest (an editor asked for 'café' gets 'caf').
    Each such character goes on a spare keycode, mapped to its keysym (0x01000000 + code
    point; Latin-1 letters keep their legacy keysyms, as X requires: 'é' on 0x010000e9 was
    typed, then the editor's Ctrl+S did nothing), with python-xlib (pyautogui's own X11 dependency); the applications get a
    moment to read the new map (a key pressed at once was read with the old one: the first
    such character was lost), then the keys are pressed through XTest and, 0.3 s later (an
    application still reading the keys would read them with the emptied map), the spare
    keycodes are emptied. More such characters than spare keycodes go in parts. The text enters only
    through `repr`; ASCII goes through pyautogui as before."""
    return (
        "\n"
        "from Xlib import X\n"
        "from Xlib.display import Display\n"
        "from Xlib.ext import xtest\n"
        "d = Display()\n"
        "lo, hi = d.display.info.min_keycode, d.display.info.max_keycode\n"
        "kmap = d.get_keyboard_mapping(lo, hi - lo + 1)\n"
        "width = len(kmap[0])\n"
        "spare = [lo + i for i, syms in enumerate(kmap) if not any(syms)]\n"
        f"text = {text!r}\n"
        "while text:\n"
        "    codes, part = {}, ''\n"
        "    for ch in text:\n"
        "        if not ch.isascii() and ch not in codes:\n"
        "            if len(codes) == len(spare):\n"
        "                break\n"
        "            codes[ch] = spare[len(codes)]\n"
        "        part += ch\n"
        "    text = text[len(part):]\n"
        "    for ch, code in codes.items():\n"
        "        sym = ord(ch) if 0xA0 <= ord(ch) <= 0xFF else 0x01000000 + ord(ch)\n"
        "        d.change_keyboard_mapping(code, [(sym,) * width])\n"
        "    d.sync()\n"
        "    time.sleep(0.1)\n"
        "    for ch in part:\n"
        "        if ch.isascii():\n"
        "            pyautogui.typewrite(ch, interval=0.005)\n"
        "            continue\n"
        "        xtest.fake_input(d, X.KeyPress, codes[ch])\n"
        "        xtest.fake_input(d, X.KeyRelease, codes[ch])\n"
        "        d.sync()\n"
        "        time.sleep(0.005)\n"
        "    time.sleep(0.3)\n"
        "    for code in codes.values():\n"
        "        d.change_keyboard_mapping(code, [(0,) * width])\n"
        "    d.sync()\n"
    )


def _point(x: int | None, y: int | None, scale: tuple[float, float]) -> str:
    assert x is not None and y is not None  # Action checks that point actions have both
    return f"{round(x * scale[0])}, {round(y * scale[1])}"


def pyautogui_command(
    action: Action, *, scale: tuple[float, float], keys: frozenset[str]
) -> str | None:
    """The pyautogui code for `action`, or None for actions that run nothing in the VM
    (wait, finished, call_user)."""
    t = action.type
    if t == ActionType.CLICK:
        return f"pyautogui.click({_point(action.x, action.y, scale)})"
    if t == ActionType.LEFT_DOUBLE:
        return f"pyautogui.doubleClick({_point(action.x, action.y, scale)})"
    if t == ActionType.RIGHT_SINGLE:
        return f"pyautogui.rightClick({_point(action.x, action.y, scale)})"
    if t == ActionType.DRAG:
        return (
            f"pyautogui.moveTo({_point(action.x, action.y, scale)}); "
            f"pyautogui.dragTo({_point(action.x2, action.y2, scale)}, "
            f"duration={DRAG_SECONDS}, button='left')"
        )
    if t == ActionType.HOTKEY:
        names = pyautogui_keys(action.key or "", keys=keys)
        return f"pyautogui.hotkey({', '.join(repr(n) for n in names)})"
    if t == ActionType.TYPE:
        text = desktop_text(action)
        if text.isascii():
            return f"pyautogui.typewrite({text!r}, interval=0.005)"
        return _type_any_script(text)
    if t == ActionType.SCROLL:
        at = _point(action.x, action.y, scale)
        clicks = {"up": SCROLL_CLICKS, "down": -SCROLL_CLICKS, "left": -SCROLL_CLICKS}.get(
            action.direction or "down", SCROLL_CLICKS
        )
        call = "hscroll" if action.direction in ("left", "right") else "scroll"
        return f"pyautogui.moveTo({at}); pyautogui.{call}({clicks})"
    if t in (ActionType.WAIT, ActionType.FINISHED, ActionType.CALL_USER):
        return None
    raise ActionNotSupported(f"osworld: no mapping for action {t.value!r}")  # pragma: no cover
