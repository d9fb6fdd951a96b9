"""Oracle demos are written in the coordinates of the image the policy actually sees."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from core.actions import parse_output
from core.imaging import QWEN25_VL, ImageGeometry
from core.protocol import TaskSpec
from envmanager.demo_collection import collect_demo
from envmanager.desktop_env import DesktopEnv

SHIPPED = Path(__file__).resolve().parents[2] / "policies" / "tiny-grounded"


def uitars_policy_dir(tmp_path: Path) -> Path:
    """A UI-TARS-1.5 / Qwen2.5-VL-sized image processor (its released bounds)."""
    QWEN25_VL.processor().save_pretrained(tmp_path)
    return tmp_path


def seen_size(policy_dir: Path, png: bytes) -> tuple[int, int]:
    """(width, height) of the image the policy's own processor makes of this screenshot."""
    processor = Qwen2VLImageProcessorPil.from_pretrained(policy_dir, local_files_only=True)
    grid = processor(images=[Image.open(io.BytesIO(png))], return_tensors="pt")["image_grid_thw"]
    patch = json.loads((policy_dir / "preprocessor_config.json").read_text())["patch_size"]
    _, rows, cols = (int(v) for v in grid[0])
    return cols * patch, rows * patch


@pytest.mark.desktop
@pytest.mark.parametrize("policy", ["shipped", "uitars"])
def test_a_desktop_demo_drag_lands_on_its_targets_in_the_image_the_policy_sees(
    desktop_env: DesktopEnv, policy: str, tmp_path: Path
) -> None:
    policy_dir = SHIPPED if policy == "shipped" else uitars_policy_dir(tmp_path)
    name = "desktop/drag-square"
    outcome = collect_demo(
        env=desktop_env,
        task=TaskSpec(name=name, env_kind="desktop", env_config={"task": name}),
        geometry=ImageGeometry.from_policy_dir(policy_dir),
    )
    assert outcome.success
    first = outcome.steps[0]
    png, width, height = first.screenshot_png, first.width, first.height
    raw, screen_action = first.raw_output, first.action
    model_w, model_h = seen_size(policy_dir, png)
    drag = parse_output(raw).action
    # Where the policy's image puts the demo's points, in screen pixels, against the widget
    # centres the oracle dragged between (at most one model pixel of rounding apart).
    for mx, my, sx, sy in (
        (drag.x, drag.y, screen_action["x"], screen_action["y"]),
        (drag.x2, drag.y2, screen_action["x2"], screen_action["y2"]),
    ):
        assert abs(mx * width / model_w - sx) <= width / model_w + 1, (raw, model_w)
        assert abs(my * height / model_h - sy) <= height / model_h + 1, (raw, model_h)
