"""Synthetic desktop episodes drawn with PIL: multi-step "do X in this app" data at the X
desktop's 800x600, with exact targets, for the desktop policy's pretraining.

Each scene imitates one kind of window the desktop tasks (`envmanager.desktop_tasks`) open,
on the desktop's black root, framed like openbox (a 1 px border, a 19 px blue title bar with
the title and two buttons, a 5 px handle below), at a random place and size:

- `web-button`: a chromium page (an infobar or not) with one to four grey buttons; the
  instruction names one: click it, then finish;
- `pad`: one to three coloured areas (the real task's light yellow among them); click,
  double-click or right-click the one named, then finish;
- `drag`: a canvas with coloured squares and an outlined "drop here" box; drag the named
  square into the box, then finish;
- `editor-type` / `editor-clear`: a text editor titled ``dartedit - <file>``; click into it,
  type the quoted text (or select all and delete), save with Ctrl+S, then finish;
- `terminal`: an xterm with a bash prompt; click into it, type ``echo <word> > <file>``
  with a newline, then finish.

A scene is an episode: every step's screen is drawn as the app would show it after the
steps before (the text typed, the selection, "(saved)" in the title, the square in the
box, the new prompt), and each step is a `core.samples.DesktopStep` with the earlier
actions as its history. Instructions come from several phrasings each, the desktop tasks'
own among them; the words, colours, files and places are drawn fresh every time, so the
policy learns to read the instruction and find the target, not one screen.

    from training.synthetic_desktop import make_episode
    steps = make_episode(random.Random(0))            # [DesktopStep, ...]
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from core.protocol import Action, ActionType
from core.samples import Box, DesktopStep
from training.synthetic import WORDS

WIDTH, HEIGHT = 800, 600  # the X desktop (envmanager.desktop_env)
TITLE_BAR = 20  # openbox: 1 px border + 19 px title bar above the client area
HANDLE = 5  # openbox's handle below the client area
FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")  # fonts-dejavu-core, as the apps use

FINISH = Action(type=ActionType.FINISHED, text="done")  # the desktop oracle's last action


@cache
def _font(size: int, kind: str = "sans") -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    name = {"sans": "DejaVuSans.ttf", "mono": "DejaVuSansMono.ttf", "bold": "DejaVuSans-Bold.ttf"}
    path = FONT_DIR / name[kind]
    if path.is_file():
        return ImageFont.truetype(str(path), size)
    return ImageFont.load_default(size)


def _text_size(text: str, size: int, kind: str = "sans") -> tuple[int, int]:
    left, top, right, bottom = _font(size, kind).getbbox(text)
    return int(right - left), int(bottom - top)


# Colour names the instructions use, each with the shades drawn for it (the pad task's
# "yellow area" is Tk's lightyellow).
AREA_COLORS: dict[str, tuple[tuple[int, int, int], ...]] = {
    "yellow": ((255, 255, 224), (255, 255, 0), (255, 236, 139)),
    "green": ((144, 238, 144), (0, 170, 0), (204, 255, 204)),
    "blue": ((173, 216, 230), (0, 0, 255), (100, 149, 237)),
    "red": ((255, 0, 0), (220, 20, 60), (255, 160, 160)),
    "grey": ((190, 190, 190), (128, 128, 128), (220, 220, 220)),
    "orange": ((255, 165, 0), (255, 200, 120)),
    "purple": ((160, 32, 240), (216, 191, 216)),
    "pink": ((255, 192, 203), (255, 105, 180)),
}
FILE_STEMS = ("notes", "draft", "list", "todo", "report", "memo", "log", "plan", "data", "done")
FILE_EXTS = (".txt", ".md", ".log")


@dataclass
class Window:
    """A framed window: `client` is the area the app draws in (screen pixels)."""

    left: int
    top: int
    width: int
    height: int
    title: str

    @property
    def client(self) -> Box:
        return (
            self.left + 1,
            self.top + TITLE_BAR,
            self.left + self.width - 1,
            self.top + self.height - HANDLE,
        )


@dataclass
class Scene:
    """One episode's fixed facts; `draw(i)` draws the screen before step i."""

    instruction: str
    actions: list[Action]
    boxes: list[tuple[Box, ...]]
    draw: Callable[[int], Image.Image]  # the screen before step i
    name: str


def _place_window(
    rng: random.Random, *, width: tuple[int, int], height: tuple[int, int]
) -> tuple[int, int, int, int]:
    """(left, top, width, height): half the time at the top-left corner, as the tasks open them."""
    w, h = rng.randint(*width), rng.randint(*height)
    if rng.random() < 0.5:
        return 0, 0, w, h
    return rng.randint(0, WIDTH - w), rng.randint(0, HEIGHT - h), w, h


def _frame(draw: ImageDraw.ImageDraw, win: Window, *, body=(255, 255, 255)) -> None:
    """openbox's decoration around `win` and its client area filled with `body`."""
    x0, y0, x1, y1 = win.left, win.top, win.left + win.width - 1, win.top + win.height - 1
    draw.rectangle((x0, y0, x1, y1), fill=(88, 90, 93))
    top, bottom = (173, 211, 255), (122, 159, 206)
    for i in range(1, TITLE_BAR - 1):
        t = (i - 1) / (TITLE_BAR - 3)
        color = tuple(round(a + (b - a) * t) for a, b in zip(top, bottom, strict=True))
        draw.line((x0 + 1, y0 + i, x1 - 1, y0 + i), fill=color)
    draw.line((x0 + 1, y0 + TITLE_BAR - 1, x1 - 1, y0 + TITLE_BAR - 1), fill=(78, 118, 168))
    tw, _ = _text_size(win.title, 8, "bold")
    draw.text(((x0 + x1 - tw) / 2, y0 + 5), win.title, fill=(255, 255, 255), font=_font(8, "bold"))
    for bx in (x1 - 28, x1 - 12):  # iconify and close
        draw.rectangle((bx, y0 + 5, bx + 8, y0 + 13), fill=(244, 245, 246), outline=(73, 103, 139))
    draw.rectangle(win.client, fill=body)
    draw.rectangle((x0 + 1, y1 - HANDLE + 1, x1 - 1, y1 - 1), fill=(234, 235, 236))


def _screen() -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (WIDTH, HEIGHT), (0, 0, 0))
    return image, ImageDraw.Draw(image)


def _centre(box: Box) -> tuple[int, int]:
    return (box[0] + box[2] - 1) // 2, (box[1] + box[3] - 1) // 2


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS).lower() for _ in range(n))


def _filename(rng: random.Random) -> str:
    return rng.choice(FILE_STEMS) + rng.choice(FILE_EXTS)


# ------------------------------------------------------------------ scenes


def _web_button(rng: random.Random) -> Scene:
    left, top, w, h = _place_window(rng, width=(360, 800), height=(300, 600))
    win = Window(left, top, w, h, rng.choice(("DartPage", "Page", _words(rng, 1).title())))
    x0, y0, x1, y1 = win.client
    infobar = rng.random() < 0.5
    area_top = y0 + (38 if infobar else 0)
    n = rng.choice((1, 1, 2, 2, 3, 4))
    labels = rng.sample(
        ["Click me", "OK", "Submit", "Next", "Cancel", "Save", "Send", "Go"]
        + [w.title() for w in rng.sample(WORDS, 4)],
        n,
    )
    big = n == 1 and rng.random() < 0.6
    boxes: list[Box] = []
    for _ in range(60):
        boxes = []
        for label in labels:
            size = rng.choice((14, 18, 24, 32, 40)) if big else rng.choice((12, 14, 16, 20))
            tw, th = _text_size(label, size)
            bw = (x1 - x0) if big else min(x1 - x0 - 4, tw + rng.randint(16, 80))
            bh = rng.randint(th + 14, max(th + 15, min(400, y1 - area_top - 10)))
            if not big:
                bh = min(bh, th + rng.randint(14, 50))
            bx = x0 if big else rng.randint(x0 + 2, x1 - bw - 2)
            by = rng.randint(area_top + 4, max(area_top + 4, y1 - bh - 4))
            boxes.append((bx, by, bx + bw, min(by + bh, y1 - 2)))
        if all(
            a[2] + 4 <= b[0] or b[2] + 4 <= a[0] or a[3] + 4 <= b[1] or b[3] + 4 <= a[1]
            for i, a in enumerate(boxes)
            for b in boxes[i + 1 :]
        ):
            break
    else:
        labels, boxes = labels[:1], boxes[:1]
    i = rng.randrange(len(labels))
    label = labels[i]
    phrasing = rng.choice(
        (
            "Click the '{l}' button on the web page.",
            "Click the '{l}' button.",
            'Click on the "{l}" button.',
            "Press the {l} button on the page.",
        )
    )
    x, y = _centre(boxes[i])
    click = Action(type=ActionType.CLICK, x=x, y=y)
    sizes = [rng.choice((14, 18, 24, 32, 40)) if big else rng.choice((12, 14, 16)) for _ in labels]

    def draw_at(step: int) -> Image.Image:
        image, draw = _screen()
        win.title = win.title if step == 0 else "Clicked"
        _frame(draw, win)
        if infobar:
            draw.line((x0, y0 + 36, x1, y0 + 36), fill=(200, 200, 200))
            note = "You are using an unsupported command-line flag: --no-sandbox."
            draw.text((x0 + 14, y0 + 12), note, fill=(60, 60, 60), font=_font(9))
            draw.text((x1 - 20, y0 + 10), "x", fill=(60, 60, 60), font=_font(11))
        for label_, box, size in zip(labels, boxes, sizes, strict=True):
            draw.rectangle(
                (box[0], box[1], box[2] - 1, box[3] - 1),
                fill=(239, 239, 239),
                outline=(118, 118, 118),
            )
            tw, th = _text_size(label_, size)
            cx, cy = _centre(box)
            draw.text((cx - tw / 2, cy - th / 2 - 2), label_, fill=(0, 0, 0), font=_font(size))
        return image

    return Scene(
        instruction=phrasing.format(l=label),
        actions=[click, FINISH],
        boxes=[(boxes[i],), ()],
        draw=draw_at,
        name="web-button",
    )


PAD_VERBS = {
    ActionType.LEFT_DOUBLE: (
        "Double-click the {c} area.",
        "Double-click on the {c} area.",
        "Double-click the {c} box.",
    ),
    ActionType.RIGHT_SINGLE: (
        "Right-click the {c} area.",
        "Right-click on the {c} area.",
        "Open the context menu of the {c} area with a right-click.",
    ),
    ActionType.CLICK: ("Click the {c} area.", "Click once on the {c} area."),
}
PAD_LABELS = {
    ActionType.LEFT_DOUBLE: "double-click me",
    ActionType.RIGHT_SINGLE: "right-click me",
    ActionType.CLICK: "click me",
}


def _pad(rng: random.Random) -> Scene:
    left, top, w, h = _place_window(rng, width=(300, 800), height=(240, 585))
    win = Window(left, top, w, h, rng.choice(("dartpad", "pad", "Tk")))
    x0, y0, x1, y1 = win.client
    kind = rng.choice(
        (
            ActionType.LEFT_DOUBLE,
            ActionType.LEFT_DOUBLE,
            ActionType.RIGHT_SINGLE,
            ActionType.RIGHT_SINGLE,
            ActionType.CLICK,
        )
    )
    n = rng.choice((1, 1, 1, 2, 3))
    names = rng.sample(sorted(AREA_COLORS), n)
    areas: list[Box] = []
    if n == 1:
        areas = [(x0, y0, x1, y1)] if rng.random() < 0.6 else [_sub_box(rng, win.client)]
    else:  # side by side or stacked
        across = rng.random() < 0.5
        for k in range(n):
            if across:
                step = (x1 - x0) // n
                areas.append((x0 + k * step, y0, x0 + (k + 1) * step, y1))
            else:
                step = (y1 - y0) // n
                areas.append((x0, y0 + k * step, x1, y0 + (k + 1) * step))
    shades = [rng.choice(AREA_COLORS[name]) for name in names]
    i = rng.randrange(n)
    text = [rng.choice((PAD_LABELS[kind], _words(rng, 2), "")) for _ in range(n)]
    if n == 1 and rng.random() < 0.7:
        text = [PAD_LABELS[kind]]
    x, y = _centre(areas[i])
    action = Action(type=kind, x=x, y=y)

    def draw_at(step: int) -> Image.Image:
        image, draw = _screen()
        _frame(draw, win)
        for box, shade, label in zip(areas, shades, text, strict=True):
            draw.rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=shade)
            if label:
                size = 24 if box[2] - box[0] > 260 else 14
                tw, th = _text_size(label, size)
                cx, cy = _centre(box)
                draw.text((cx - tw / 2, cy - th / 2), label, fill=(0, 0, 0), font=_font(size))
        return image

    return Scene(
        instruction=rng.choice(PAD_VERBS[kind]).format(c=names[i]),
        actions=[action, FINISH],
        boxes=[(areas[i],), ()],
        draw=draw_at,
        name=f"pad-{kind.value}",
    )


def _sub_box(rng: random.Random, within: Box) -> Box:
    x0, y0, x1, y1 = within
    w = rng.randint(min(120, x1 - x0), x1 - x0)
    h = rng.randint(min(80, y1 - y0), y1 - y0)
    left, top = rng.randint(x0, x1 - w), rng.randint(y0, y1 - h)
    return left, top, left + w, top + h


def _drag(rng: random.Random) -> Scene:
    left, top, w, h = _place_window(rng, width=(480, 800), height=(360, 585))
    win = Window(left, top, w, h, "dartdrag")
    x0, y0, x1, y1 = win.client
    side = rng.randint(40, 100)
    target_w = rng.randint(max(side + 30, 110), 220)
    names = rng.sample([n for n in AREA_COLORS if n not in ("grey",)], 3)
    square_name, box_name, other_name = names
    for _ in range(100):
        tx = rng.randint(x0 + 10, x1 - target_w - 10)
        ty = rng.randint(y0 + 30, max(y0 + 30, y1 - target_w - 10))
        target = (tx, ty, tx + target_w, ty + target_w)
        sx, sy = rng.randint(x0 + 5, x1 - side - 5), rng.randint(y0 + 5, y1 - side - 5)
        square = (sx, sy, sx + side, sy + side)
        if (
            square[2] + 20 < target[0]
            or target[2] + 20 < square[0]
            or square[3] + 20 < target[1] - 24
        ):
            break
    distractor = None
    if rng.random() < 0.4:
        dx, dy = rng.randint(x0 + 5, x1 - side - 5), rng.randint(y0 + 5, y1 - side - 5)
        d = (dx, dy, dx + side, dy + side)
        if all(
            d[2] + 8 < b[0] or b[2] + 8 < d[0] or d[3] + 8 < b[1] or b[3] + 8 < d[1]
            for b in (square, target)
        ):
            distractor = d
    colors = {k: rng.choice(AREA_COLORS[k])[:3] for k in names}
    colors[square_name] = AREA_COLORS[square_name][0] if rng.random() < 0.5 else colors[square_name]
    start, end = _centre(square), _centre(target)
    drag = Action(type=ActionType.DRAG, x=start[0], y=start[1], x2=end[0], y2=end[1])
    phrasing = rng.choice(
        (
            "Drag the {s} square into the {b} 'drop here' box.",
            "Drag the {s} square into the {b} box.",
            "Move the {s} square into the {b} 'drop here' box by dragging it.",
        )
    )

    def draw_at(step: int) -> Image.Image:
        image, draw = _screen()
        win.title = "dartdrag" if step == 0 else "dartdrag - dropped"
        _frame(draw, win)
        draw.rectangle(target, outline=colors[box_name], width=3)
        tw, _ = _text_size("drop here", 14)
        draw.text(
            ((target[0] + target[2] - tw) / 2, target[1] - 22),
            "drop here",
            fill=(0, 0, 0),
            font=_font(14),
        )
        if distractor is not None:
            draw.rectangle(distractor, fill=colors[other_name], outline=(0, 0, 0))
        moved = (
            square
            if step == 0
            else (
                end[0] - side // 2,
                end[1] - side // 2,
                end[0] - side // 2 + side,
                end[1] - side // 2 + side,
            )
        )
        draw.rectangle(moved, fill=colors[square_name], outline=(0, 0, 0))
        return image

    return Scene(
        instruction=phrasing.format(s=square_name, b=box_name),
        actions=[drag, FINISH],
        boxes=[(square, target), ()],
        draw=draw_at,
        name="drag",
    )


def _editor_window(rng: random.Random, filename: str) -> Window:
    left, top, w, h = _place_window(rng, width=(420, 800), height=(300, 585))
    return Window(left, top, w, h, f"dartedit - {filename}")


def _draw_editor(
    draw: ImageDraw.ImageDraw, win: Window, lines: list[str], *, selected: bool, caret: bool
) -> None:
    x0, y0, x1, _ = win.client
    line_h = 19
    for k, line in enumerate(lines):
        y = y0 + 2 + k * line_h
        if selected and (line or k < len(lines) - 1):
            draw.rectangle((x0 + 1, y, x1 - 2, y + line_h - 1), fill=(195, 195, 195))
        draw.text((x0 + 2, y + 1), line, fill=(0, 0, 0), font=_font(14, "mono"))
    if caret:
        k = len(lines) - 1
        tw, _ = _text_size(lines[-1] + "|", 14, "mono") if lines[-1] else (0, 0)
        cx = x0 + 2 + max(0, tw - _text_size("|", 14, "mono")[0])
        draw.line((cx + 1, y0 + 3 + k * line_h, cx + 1, y0 + 2 + (k + 1) * line_h - 2), fill=0)


def _editor_type(rng: random.Random) -> Scene:
    filename = _filename(rng)
    win = _editor_window(rng, filename)
    text = rng.choice(("hello desktop", _words(rng, 2), _words(rng, 1), _words(rng, 3)))
    phrasing = rng.choice(
        (
            "Type '{t}' into the editor and save the file with Ctrl+S.",
            "Write '{t}' in the editor, then save with Ctrl+S.",
            "Enter the text '{t}' in {f} and save it with Ctrl+S.",
        )
    )
    centre = _centre(win.client)
    actions = [
        Action(type=ActionType.CLICK, x=centre[0], y=centre[1]),
        Action(type=ActionType.TYPE, text=text),
        Action(type=ActionType.HOTKEY, key="ctrl s"),
        FINISH,
    ]

    def draw_at(step: int) -> Image.Image:
        image, draw = _screen()
        win.title = f"dartedit - {filename}" + (" (saved)" if step >= 3 else "")
        _frame(draw, win)
        _draw_editor(draw, win, [text if step >= 2 else ""], selected=False, caret=True)
        return image

    return Scene(
        instruction=phrasing.format(t=text, f=filename),
        actions=actions,
        boxes=[(win.client,), (), (), ()],
        draw=draw_at,
        name="editor-type",
    )


def _editor_clear(rng: random.Random) -> Scene:
    filename = _filename(rng)
    win = _editor_window(rng, filename)
    lines = [_words(rng, rng.randint(1, 4)) for _ in range(rng.randint(1, 6))] + [""]
    phrasing = rng.choice(
        (
            "Delete all the text in the editor and save the empty file with Ctrl+S.",
            "Clear the editor and save the empty file with Ctrl+S.",
            "Remove everything in {f} and save it with Ctrl+S.",
        )
    )
    centre = _centre(win.client)
    actions = [
        Action(type=ActionType.CLICK, x=centre[0], y=centre[1]),
        Action(type=ActionType.HOTKEY, key="ctrl a"),
        Action(type=ActionType.HOTKEY, key="delete"),
        Action(type=ActionType.HOTKEY, key="ctrl s"),
        FINISH,
    ]

    def draw_at(step: int) -> Image.Image:
        image, draw = _screen()
        win.title = f"dartedit - {filename}" + (" (saved)" if step >= 4 else "")
        _frame(draw, win)
        shown = lines if step < 3 else [""]
        _draw_editor(draw, win, shown, selected=step == 2, caret=step != 2)
        return image

    return Scene(
        instruction=phrasing.format(f=filename),
        actions=actions,
        boxes=[(win.client,), (), (), (), ()],
        draw=draw_at,
        name="editor-clear",
    )


def _terminal(rng: random.Random) -> Scene:
    left, top, w, h = _place_window(rng, width=(400, 800), height=(260, 585))
    if rng.random() < 0.5:
        left, top, w, h = 0, 0, 606, 419  # xterm's 100x30 at the corner, as the task opens it
    win = Window(left, top, w, h, rng.choice(("dart-term", "xterm", "bash")))
    word = rng.choice(("ok", "yes", "done", _words(rng, 1)))
    filename = _filename(rng)
    prompt = "bash-5.2$ "
    earlier = [f"{prompt}ls", _words(rng, 3)] if rng.random() < 0.3 else []
    phrasing = rng.choice(
        (
            "Using the terminal, create a file named {f} containing the word {w}.",
            "In the terminal, make a file {f} that contains {w}.",
            "Use the terminal to write the word {w} into a new file named {f}.",
        )
    )
    centre = _centre(win.client)
    command = f"echo {word} > {filename}"
    actions = [
        Action(type=ActionType.CLICK, x=centre[0], y=centre[1]),
        Action(type=ActionType.TYPE, text=command + "\n"),
        FINISH,
    ]

    def draw_at(step: int) -> Image.Image:
        image, draw = _screen()
        _frame(draw, win)
        x0, y0, _, _ = win.client
        lines = [*earlier, prompt + (command if step >= 2 else "")]
        if step >= 2:
            lines.append(prompt)
        for k, line in enumerate(lines):
            draw.text((x0 + 2, y0 + 2 + k * 13), line, fill=(0, 0, 0), font=_font(10, "mono"))
        cw, _ = _text_size(lines[-1] + "x", 10, "mono")
        cx = x0 + 2 + cw - _text_size("x", 10, "mono")[0] + 1
        draw.rectangle(
            (cx, y0 + 3 + (len(lines) - 1) * 13, cx + 5, y0 + 13 + (len(lines) - 1) * 13),
            fill=(0, 0, 0),
        )
        return image

    return Scene(
        instruction=phrasing.format(f=filename, w=word),
        actions=actions,
        boxes=[(win.client,), (), ()],
        draw=draw_at,
        name="terminal",
    )


SCENES: dict[str, Callable[[random.Random], Scene]] = {
    "web-button": _web_button,
    "pad": _pad,
    "drag": _drag,
    "editor-type": _editor_type,
    "editor-clear": _editor_clear,
    "terminal": _terminal,
}


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _step(made: Scene, i: int) -> DesktopStep:
    return DesktopStep(
        png=_png(made.draw(i)),
        width=WIDTH,
        height=HEIGHT,
        instruction=made.instruction,
        history=tuple(made.actions[:i]),
        action=made.actions[i],
        boxes=made.boxes[i],
        source=f"desktop/{made.name}",
    )


def _scene(rng: random.Random, scene: str | None) -> Scene:
    if scene is not None and scene not in SCENES:
        raise ValueError(f"unknown scene {scene!r}; expected one of {sorted(SCENES)}")
    return SCENES[scene or rng.choice(sorted(SCENES))](rng)


def make_episode(rng: random.Random, *, scene: str | None = None) -> list[DesktopStep]:
    """Every step of one synthetic episode (a random scene unless `scene` names one)."""
    made = _scene(rng, scene)
    return [_step(made, i) for i in range(len(made.actions))]


def make_step(rng: random.Random, *, scene: str | None = None) -> DesktopStep:
    """One step drawn uniformly from a fresh episode (only that step's screen is drawn)."""
    made = _scene(rng, scene)
    return _step(made, rng.randrange(len(made.actions)))
