"""The image a Qwen-VL policy sees: its resize rule and the bounds of its image processor.

Everything that maps coordinates between the screen and the model image, or counts image
tokens, takes an `ImageGeometry`. A geometry comes from the policy's processor
(`ImageGeometry.from_policy_dir`, or what the inference server reports, which reads the
same processor): rollout, demos, uploads, prompts, pretraining and evaluation all agree
with the image the model actually sees. A pixel bound written anywhere else would drift
from the processor's: an 800x600 desktop is 812x588 to Qwen2.5-VL's bounds and 504x364 to
the shipped tiny policy's, and a demo's clicks must be in the one the policy sees.

    >>> QWEN25_VL.model_size(width=800, height=600)
    (812, 588)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_RATIO = 200
QWEN_PATCH = 14
QWEN_MERGE = 2


class ProcessorNotSupported(ValueError):
    """A policy's image processor is not one whose resize rule Dartboard knows."""


GEOMETRY_FILE = "preprocessor_config.json"  # where a checkpoint keeps its image geometry


@dataclass(frozen=True)
class ImageGeometry:
    """How a screenshot becomes the model's image.

    factor: pixels per side of one image token (patch size x spatial merge; 28 for
        Qwen2-VL / Qwen2.5-VL / UI-TARS-1.5, 32 for Qwen3-VL's released checkpoints).
    min_pixels, max_pixels: the processor's bounds on the resized image's pixel count.
    """

    factor: int
    min_pixels: int
    max_pixels: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.min_pixels <= 0 or self.max_pixels < self.min_pixels:
            raise ValueError(
                f"image geometry needs factor > 0 and 0 < min_pixels <= max_pixels, got {self}"
            )

    @classmethod
    def from_tokens(cls, *, min_tokens: int, max_tokens: int, factor: int) -> ImageGeometry:
        """Bounds given in image tokens (one token per factor x factor pixels)."""
        return cls(factor, min_tokens * factor * factor, max_tokens * factor * factor)

    @classmethod
    def from_processor_config(cls, data: dict[str, Any], *, where: str = "") -> ImageGeometry:
        """From a Qwen2-VL-style `preprocessor_config.json` (transformers writes the bounds
        as size.shortest_edge / size.longest_edge; older files as min_pixels / max_pixels)."""
        where = where or "preprocessor_config.json"
        try:
            factor = int(data.get("patch_size", QWEN_PATCH)) * int(
                data.get("merge_size", QWEN_MERGE)
            )
            size = data.get("size") or {}
            low = int(data.get("min_pixels") or size["shortest_edge"])
            high = int(data.get("max_pixels") or size["longest_edge"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProcessorNotSupported(
                f"{where}: not a Qwen-VL image processor (needs patch_size, merge_size and "
                f"min/max pixels, or size.shortest_edge/longest_edge): {exc!r}"
            ) from None
        return cls(factor, low, high)

    @classmethod
    def from_policy_dir(cls, path: str | Path) -> ImageGeometry:
        """The geometry of the policy checkpoint at `path` (its preprocessor_config.json)."""
        config = Path(path) / GEOMETRY_FILE
        if not config.is_file():
            raise ProcessorNotSupported(f"{config}: missing; a policy needs its image processor")
        return cls.from_processor_config(json.loads(config.read_text()), where=str(config))

    @classmethod
    def from_json(cls, data: Any) -> ImageGeometry:
        """From `to_json()` as an inference server reports it."""
        if not isinstance(data, dict):
            raise ValueError(f"image geometry must be an object, got {data!r}")
        return cls(int(data["factor"]), int(data["min_pixels"]), int(data["max_pixels"]))

    def processor(self) -> Any:
        """The Qwen2-VL image processor of this geometry (the inverse of
        `from_processor_config`): how a checkpoint built here gets its bounds, so the numbers
        are written in one place."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        return Qwen2VLImageProcessorPil(
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            patch_size=self.factor // QWEN_MERGE,
            merge_size=QWEN_MERGE,
        )

    def to_json(self) -> dict[str, int]:
        return {"factor": self.factor, "min_pixels": self.min_pixels, "max_pixels": self.max_pixels}

    def resize(self, height: int, width: int) -> tuple[int, int]:
        """Qwen-VL's `smart_resize`; returns ``(height, width)`` (note the order, as in Qwen).

        Both sides become multiples of `factor` (Python `round`, i.e. half to even), the
        pixel count is brought within [min_pixels, max_pixels] keeping the aspect ratio, and
        an aspect ratio above 200 raises ValueError. Same as ``qwen_vl_utils.smart_resize``;
        it agrees with transformers' Qwen2-VL image processor for every side above 14 px.
        """
        factor = self.factor
        if height <= 0 or width <= 0:
            raise ValueError(f"image size must be positive, got height={height} width={width}")
        if max(height, width) / min(height, width) > MAX_RATIO:
            raise ValueError(
                f"absolute aspect ratio must be at most {MAX_RATIO}, "
                f"got {max(height, width) / min(height, width)}"
            )
        h_bar = max(factor, round(height / factor) * factor)
        w_bar = max(factor, round(width / factor) * factor)
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def model_size(self, *, width: int, height: int) -> tuple[int, int]:
        """The ``(width, height)`` of the image the model sees for a screen of this size."""
        h_bar, w_bar = self.resize(height, width)
        return w_bar, h_bar

    def tokens(self, *, width: int, height: int) -> int:
        """Image tokens the model spends on a screen of this size."""
        h_bar, w_bar = self.resize(height, width)
        return (h_bar // self.factor) * (w_bar // self.factor)


QWEN25_VL = ImageGeometry.from_tokens(
    min_tokens=4, max_tokens=16384, factor=QWEN_PATCH * QWEN_MERGE
)
"""UI-TARS-1.5 / Qwen2.5-VL's released `preprocessor_config.json`."""
