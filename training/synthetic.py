"""Synthetic grounding screens drawn with PIL: cheap "click X" data with exact targets.

Each screen imitates a MiniWoB++ page (160x210 px, the instruction in a yellow bar on top,
widgets on white below) with one of five layouts: buttons, links inside a paragraph, text
fields, a dialog with a close "x", and coloured boxes. The instruction names one widget;
the sample's click is the centre of that widget's box. Drawing one screen takes ~1 ms.

    from training.synthetic import make_sample
    s = make_sample(random.Random(0))          # GroundingSample(png=..., box=..., x=..., y=...)
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable
from functools import cache

from PIL import Image, ImageDraw, ImageFont

from core.samples import Box, GroundingSample

WIDTH, HEIGHT = 160, 210  # MiniWoB's task area
BAR_HEIGHT = 50  # the yellow instruction bar


WORDS = [
    "ok",
    "cancel",
    "submit",
    "yes",
    "no",
    "next",
    "previous",
    "back",
    "close",
    "open",
    "save",
    "delete",
    "search",
    "login",
    "start",
    "stop",
    "edit",
    "copy",
    "paste",
    "print",
    "help",
    "home",
    "send",
    "reply",
    "share",
    "like",
    "more",
    "less",
    "apply",
    "reset",
    "done",
    "lorem",
    "ipsum",
    "dolor",
    "sit",
    "amet",
    "mauris",
    "velit",
    "nunc",
    "vitae",
    "turpis",
    "eget",
    "tellus",
    "morbi",
    "proin",
    "augue",
    "nulla",
    "porta",
    "magna",
    "felis",
    "justo",
    "odio",
    "diam",
    "urna",
    "risus",
    "sed",
    "dui",
    "quis",
    "leo",
    "ante",
]
COLORS = {
    "red": (255, 0, 0),
    "blue": (0, 0, 255),
    "olive": (128, 128, 0),
    "lime": (0, 255, 0),
    "black": (0, 0, 0),
    "white": (255, 255, 255),
    "grey": (128, 128, 128),
    "purple": (128, 0, 128),
    "orange": (255, 165, 0),
    "yellow": (255, 255, 0),
    "cyan": (0, 255, 255),
    "pink": (255, 192, 203),
    "magenta": (255, 0, 255),
}
ORDINALS = ("1st", "2nd", "3rd")


@cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size)


def _word(rng: random.Random) -> str:
    word = rng.choice(WORDS)
    return rng.choice((word, word.capitalize(), word.upper())) if rng.random() < 0.5 else word


def _text_size(text: str, size: int) -> tuple[int, int]:
    left, top, right, bottom = _font(size).getbbox(text)
    return int(right - left), int(bottom - top)


def _place(rng: random.Random, w: int, h: int, taken: list[Box], tries: int = 40) -> Box | None:
    """A free w x h box in the widget area (below the bar), or None."""
    for _ in range(tries):
        if w >= WIDTH - 2 or h >= HEIGHT - BAR_HEIGHT - 4:
            return None
        left = rng.randint(1, WIDTH - w - 1)
        top = rng.randint(BAR_HEIGHT + 2, HEIGHT - h - 2)
        box = (left, top, left + w, top + h)
        if all(
            box[2] + 2 <= t[0] or t[2] + 2 <= box[0] or box[3] + 2 <= t[1] or t[3] + 2 <= box[1]
            for t in taken
        ):
            taken.append(box)
            return box
    return None


def _button(draw: ImageDraw.ImageDraw, box: Box, text: str, size: int) -> None:
    draw.rounded_rectangle(
        (box[0], box[1], box[2] - 1, box[3] - 1),
        radius=3,
        fill=(239, 239, 239),
        outline=(118, 118, 118),
    )
    tw, th = _text_size(text, size)
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    draw.text((cx - tw / 2, cy - th / 2 - 1), text, fill=(0, 0, 0), font=_font(size))


def _buttons(rng: random.Random, draw: ImageDraw.ImageDraw) -> tuple[str, Box] | None:
    n = rng.choice((1, 1, 2, 2, 3, 4, 5, 6))
    size = rng.choice((10, 11, 12, 13))
    words = rng.sample(WORDS, n)
    if n == 2 and rng.random() < 0.4:
        words = ["ONE", "TWO"]
    taken: list[Box] = []
    boxes = []
    for word in words:
        tw, th = _text_size(word, size)
        w, h = tw + rng.randint(8, 20), th + rng.randint(8, 22)
        if (box := _place(rng, w, h, taken)) is None:
            return None
        _button(draw, box, word, size)
        boxes.append(box)
    i = rng.randrange(n)
    if n == 1 and rng.random() < 0.5:
        return "Click the button.", boxes[i]
    form = rng.choice(('Click on the "{w}" button.', "Click button {w}.", 'Click "{w}".'))
    return form.format(w=words[i]), boxes[i]


def _links(rng: random.Random, draw: ImageDraw.ImageDraw) -> tuple[str, Box] | None:
    size = rng.choice((10, 11, 12))
    line_h = _text_size("Ag", size)[1] + rng.randint(3, 6)
    x, y = rng.randint(1, 6), rng.randint(BAR_HEIGHT + 2, BAR_HEIGHT + 40)
    links: list[tuple[str, Box]] = []
    space = _text_size("a a", size)[0] - 2 * _text_size("a", size)[0] + 2
    for _ in range(rng.randint(8, 30)):
        word = _word(rng) + rng.choice(("", "", "", ",", "."))
        tw, _ = _text_size(word, size)
        if x + tw > WIDTH - 2:
            x, y = rng.randint(1, 6), y + line_h
        if y + line_h > HEIGHT - 2:
            break
        is_link = rng.random() < 0.3 and all(w != word for w, _ in links)
        color = (0, 0, 238) if is_link else (0, 0, 0)
        draw.text((x, y), word, fill=color, font=_font(size))
        if is_link:
            draw.line((x, y + line_h - 3, x + tw, y + line_h - 3), fill=color)
            links.append((word, (x, y, x + tw + 1, y + line_h - 1)))
        x += tw + space
    if not links:
        return None
    word, box = rng.choice(links)
    return f'Click on the link "{word}".', box


def _fields(rng: random.Random, draw: ImageDraw.ImageDraw) -> tuple[str, Box] | None:
    n = rng.choice((1, 1, 2, 3))
    taken: list[Box] = []
    boxes = []
    for _ in range(n):
        w, h = rng.randint(60, 140), rng.randint(16, 24)
        if (box := _place(rng, w, h, taken)) is None:
            return None
        draw.rectangle(
            (box[0], box[1], box[2] - 1, box[3] - 1), fill=(255, 255, 255), outline=(118, 118, 118)
        )
        boxes.append(box)
    boxes.sort(key=lambda b: (b[1], b[0]))
    i = rng.randrange(n)
    if n == 1:
        return rng.choice(("Focus into the textbox.", "Click on the text field.")), boxes[0]
    return f"Focus into the {ORDINALS[i]} input textbox.", boxes[i]


def _dialog(rng: random.Random, draw: ImageDraw.ImageDraw) -> tuple[str, Box] | None:
    w, h = rng.randint(90, 150), rng.randint(60, 110)
    taken: list[Box] = []
    if (box := _place(rng, w, h, taken)) is None:
        return None
    left, top, right, bottom = box
    draw.rectangle(
        (left, top, right - 1, bottom - 1), fill=(255, 255, 255), outline=(170, 170, 170)
    )
    draw.rectangle(
        (left + 3, top + 3, right - 4, top + 22), fill=(233, 233, 233), outline=(221, 221, 221)
    )
    close = (right - 22, top + 5, right - 6, top + 21)
    draw.rectangle(
        (close[0], close[1], close[2] - 1, close[3] - 1),
        fill=(246, 246, 246),
        outline=(197, 197, 197),
    )
    draw.line((close[0] + 5, close[1] + 5, close[2] - 6, close[3] - 6), fill=(60, 60, 60), width=2)
    draw.line((close[0] + 5, close[3] - 6, close[2] - 6, close[1] + 5), fill=(60, 60, 60), width=2)
    draw.text(
        (left + 8, top + 30), " ".join(_word(rng) for _ in range(3)), fill=(0, 0, 0), font=_font(11)
    )
    buttons = []
    if rng.random() < 0.5 and h >= 70:
        bx = left + 8
        for word in rng.sample(("OK", "Cancel", "Yes", "No"), 2):
            tw, th = _text_size(word, 11)
            bbox = (bx, bottom - th - 16, bx + tw + 12, bottom - 6)
            _button(draw, bbox, word, 11)
            buttons.append((word, bbox))
            bx = bbox[2] + 6
    if buttons and rng.random() < 0.5:
        word, bbox = rng.choice(buttons)
        return f'Close the dialog box by clicking the "{word}".', bbox
    return 'Close the dialog box by clicking the "x".', close


def _colors(rng: random.Random, draw: ImageDraw.ImageDraw) -> tuple[str, Box] | None:
    n = rng.choice((2, 3, 4, 6, 9))
    names = rng.sample(sorted(COLORS), n)
    cols = 3 if n in (3, 6, 9) else 2
    size = rng.randint(26, 48)
    left0 = rng.randint(0, max(0, WIDTH - cols * size - 2))
    top0 = rng.randint(
        BAR_HEIGHT + 4, max(BAR_HEIGHT + 4, HEIGHT - ((n + cols - 1) // cols) * size - 2)
    )
    boxes = []
    for i, name in enumerate(names):
        left, top = left0 + (i % cols) * size, top0 + (i // cols) * size
        box = (left, top, left + size, top + size)
        if box[3] > HEIGHT:
            return None
        draw.rectangle(
            (left, top, left + size - 1, top + size - 1), fill=COLORS[name], outline=(40, 40, 40)
        )
        boxes.append(box)
    i = rng.randrange(n)
    return f"Click on the {names[i]} colored box.", boxes[i]


LAYOUTS: dict[str, Callable[[random.Random, ImageDraw.ImageDraw], tuple[str, Box] | None]] = {
    "buttons": _buttons,
    "links": _links,
    "fields": _fields,
    "dialog": _dialog,
    "colors": _colors,
}


def _bar(draw: ImageDraw.ImageDraw, instruction: str) -> None:
    """The yellow instruction bar, text wrapped at the screen width like MiniWoB's."""
    draw.rectangle((0, 0, WIDTH - 1, BAR_HEIGHT - 1), fill=(255, 255, 0))
    line, y = "", 2
    for word in instruction.split():
        trial = f"{line} {word}".strip()
        if _text_size(trial, 11)[0] > WIDTH - 6 and line:
            draw.text((3, y), line, fill=(0, 0, 0), font=_font(11))
            line, y = word, y + 13
        else:
            line = trial
    draw.text((3, y), line, fill=(0, 0, 0), font=_font(11))


def make_sample(rng: random.Random, *, layout: str | None = None) -> GroundingSample:
    """One synthetic screen (a random layout unless `layout` names one of `LAYOUTS`)."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    while True:
        name = layout or rng.choice(sorted(LAYOUTS))
        image = Image.new("RGB", (WIDTH, HEIGHT), (255, 255, 255))
        draw = ImageDraw.Draw(image)
        made = LAYOUTS[name](rng, draw)
        if made is None:
            continue
        instruction, box = made
        _bar(draw, instruction)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return GroundingSample(
            png=buffer.getvalue(),
            width=WIDTH,
            height=HEIGHT,
            instruction=instruction,
            x=(box[0] + box[2] - 1) // 2,
            y=(box[1] + box[3] - 1) // 2,
            box=box,
            source=f"synthetic/{name}",
        )


def box_sample(box: Box) -> GroundingSample:
    """The smallest grounding screen: a blank page under the yellow bar with one dark box,
    the target of "Click the box" (bench/grounding_probe.py and the tests use it)."""
    img = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle([0, 0, WIDTH - 1, BAR_HEIGHT - 1], fill=(255, 255, 0))
    draw.rectangle([box[0], box[1], box[2] - 1, box[3] - 1], fill=(60, 60, 60))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return GroundingSample(
        png=buf.getvalue(),
        width=WIDTH,
        height=HEIGHT,
        instruction="Click the box",
        x=(box[0] + box[2]) // 2,
        y=(box[1] + box[3]) // 2,
        box=box,
        source="probe/box",
    )
