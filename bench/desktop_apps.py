"""What a Dartboard desktop with OSWorld's applications costs: its memory with each app open,
the time to start the app on a document, and the reset between tasks (the apps stopped, the
home emptied), next to what OSWorld's own docker provider gives one VM (4 GiB, 4 cores).

    .venv/bin/python bench/desktop_apps.py [--repeats 3]

Memory is the proportional set size (PSS, /proc/<pid>/smaps_rollup) of the desktop's
processes: its Xvfb, and everything running as the sandbox's uid (the window manager and
the app). Needs `make desktop-apps`; an app that is not installed is left out.
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import time
from pathlib import Path

import docx
import openpyxl
from PIL import Image
from pptx import Presentation

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envmanager.osworld_desktop import OSWorldDesktop

MIB = 1024 * 1024


def _xlsx() -> bytes:
    book = openpyxl.Workbook()
    book.active.append(["item", "price"])
    out = io.BytesIO()
    book.save(out)
    return out.getvalue()


def _docx() -> bytes:
    document, out = docx.Document(), io.BytesIO()
    document.add_paragraph("A note.")
    document.save(out)
    return out.getvalue()


def _pptx() -> bytes:
    deck, out = Presentation(), io.BytesIO()
    deck.slides.add_slide(deck.slide_layouts[5]).shapes.title.text = "Roadmap"
    deck.save(out)
    return out.getvalue()


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (640, 480), "white").save(out, format="PNG")
    return out.getvalue()


# app -> (program that must be installed, file name, its bytes, the command, window title part)
APPS = {
    "none (the desktop alone)": (None, None, None, None, None),
    "LibreOffice Calc": ("libreoffice", "t.xlsx", _xlsx, ["libreoffice", "--calc"], "t.xlsx"),
    "LibreOffice Writer": ("libreoffice", "t.docx", _docx, ["libreoffice", "--writer"], "t.docx"),
    "LibreOffice Impress": ("libreoffice", "t.pptx", _pptx, ["libreoffice", "--impress"], "t.pptx"),
    "GIMP": ("gimp", "t.png", _png, ["gimp"], "GNU Image"),
    "VLC": ("vlc", None, None, ["vlc"], "VLC media player"),
    "Thunderbird": ("thunderbird", None, None, ["thunderbird"], "Thunderbird"),
    "Chromium (google-chrome)": (
        "chromium",
        None,
        None,
        ["google-chrome", "about:blank"],
        "Chromium",
    ),
}  # fmt: skip  (one app a line)


def _pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total / MIB


def _desktop_pids(desktop: OSWorldDesktop) -> list[int]:
    uid = desktop._sandbox().uid
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        name = fields.get("Name", "").strip()
        if int(fields.get("Uid", "-1").split()[0]) == uid or (
            name == "Xvfb" and f":{desktop.display.lstrip(':')}" in _cmdline(status.parent)
        ):
            pids.append(int(status.parent.name))
    return pids


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def measure(desktop: OSWorldDesktop, app: str, repeats: int) -> dict[str, float] | None:
    program, name, make, command, title = APPS[app]
    if program is not None and shutil.which(program) is None:
        return None
    starts, resets, memory = [], [], []
    for _ in range(repeats):
        started = time.monotonic()
        desktop.reset()
        resets.append(time.monotonic() - started)
        if command is not None:
            argv = list(command)
            if name is not None:
                desktop.write_file(f"/home/user/{name}", make())
                argv.append(f"/home/user/{name}")
            started = time.monotonic()
            desktop.launch(argv)
            while not any(title.lower() in t.lower() for _, t in desktop.windows()):
                if time.monotonic() - started > 120:
                    raise RuntimeError(f"{app}: no window in 120 s")
                time.sleep(0.2)
            starts.append(time.monotonic() - started)
            time.sleep(3)  # the app settles (its first document drawn) before it is measured
        memory.append(_pss_mib(_desktop_pids(desktop)))
    return {
        "start": statistics.median(starts) if starts else 0.0,
        "reset": statistics.median(resets),
        "memory": statistics.median(memory),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    desktop = OSWorldDesktop()
    desktop.start()
    try:
        print("| app | memory (PSS, MiB) | start to window (s) | reset after it (s) |")
        print("|---|---:|---:|---:|")
        for app in APPS:
            row = measure(desktop, app, args.repeats)
            if row is None:
                print(f"| {app} | not installed | | |")
                continue
            start = f"{row['start']:.1f}" if APPS[app][3] else "-"
            print(f"| {app} | {row['memory']:.0f} | {start} | {row['reset']:.2f} |")
    finally:
        desktop.close()
    print(f"\nmedians of {args.repeats} runs; an OSWorld VM under its docker provider: 4096 MiB "
          "and 4 cores reserved (desktop_env/providers/docker/provider.py)")  # fmt: skip


if __name__ == "__main__":
    main()
