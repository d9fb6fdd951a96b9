"""A frozen vision tower's output per screenshot, computed once per update however many steps
show it. An episode's step shows its last `max_images` screenshots, so under LoRA on the
language model (the vision tower frozen) one screenshot goes through the tower up to that
many times in one update, and again in each micro-batch's reference and gradient passes;
here it goes once.

The tower attends within each image (Qwen2-VL, Qwen2.5-VL and Qwen3-VL: full attention over
one image's patches, windows within it), so an image's output does not depend on the other
images encoded beside it: the images missing from the cache are encoded together, and the
model is handed the cached outputs in the batch's order, as `get_image_features` gives them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core.encoding import EncodedBatch

Encode = Callable[[EncodedBatch], Any]  # a batch's images -> the model's get_image_features


@dataclass
class _Image:
    pooled: torch.Tensor  # [image tokens, hidden]
    deepstack: list[torch.Tensor] | None  # Qwen3-VL: one [image tokens, hidden] per layer


class ImageFeatures:
    """The update's image features by the image's content (its patches and grid); at most
    `max_images` kept (0: none), the least recently used dropped; cleared between updates.
    At 7B a 1920x1080 screenshot's features are 19 MB in bf16: 64 of them 1.2 GB."""

    def __init__(self, max_images: int = 64) -> None:
        self.max_images = max_images
        self._images: OrderedDict[bytes, _Image] = OrderedDict()
        self._output_type: type | None = None
        self.encoded = 0  # images that went through the tower since the last clear
        self.reused = 0  # images served from the cache since the last clear

    def of(self, batch: EncodedBatch, encode: Encode) -> Any:
        """The batch's image features, as `encode` (the model's `get_image_features`) gives
        them for all its images, encoding only the images not seen in this update."""
        assert batch.patches is not None and batch.image_grid_thw is not None
        if self.max_images <= 0:  # nothing kept: every pass encodes its images
            return encode(batch)
        sizes = batch.image_grid_thw.prod(-1).tolist()
        pieces = torch.split(batch.patches, sizes)
        keys = list(batch.image_keys) or [
            _key(piece, grid) for piece, grid in zip(pieces, batch.image_grid_thw, strict=True)
        ]
        missing = list(dict.fromkeys(k for k in keys if k not in self._images))
        if missing:
            first = {k: i for i, k in reversed(list(enumerate(keys)))}
            rows = [first[k] for k in missing]
            sub = _images_of(batch, pieces, rows)
            out = encode(sub)
            self._output_type = type(out)
            deep = getattr(out, "deepstack_features", None)
            for j, key in enumerate(missing):
                self._images[key] = _Image(
                    pooled=out.pooler_output[j],
                    deepstack=[layer[j] for layer in deep] if deep is not None else None,
                )
            self.encoded += len(missing)
        self.reused += len(keys) - len(missing)
        for key in keys:
            self._images.move_to_end(key)
        shown = [self._images[k] for k in keys]
        while len(self._images) > max(self.max_images, len(set(keys))):
            self._images.popitem(last=False)
        return self._assemble(shown)

    def _assemble(self, shown: list[_Image]) -> Any:
        assert self._output_type is not None
        fields: dict[str, Any] = {"pooler_output": tuple(i.pooled for i in shown)}
        if shown and shown[0].deepstack is not None:
            layers = len(shown[0].deepstack)
            fields["deepstack_features"] = [
                tuple(i.deepstack[layer] for i in shown if i.deepstack is not None)
                for layer in range(layers)
            ]
        return self._output_type(**fields)

    def clear(self) -> None:
        self._images.clear()
        self.encoded = self.reused = 0


def _key(patches: torch.Tensor, grid: torch.Tensor) -> bytes:
    """An image's content key where the batch carries none: a hash of its uint8 patches and
    its grid (about 30 ms for a 1920x1080 screenshot's, on this CPU)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(grid.cpu().numpy().tobytes())
    digest.update(patches.detach().cpu().contiguous().numpy().tobytes())
    return digest.digest()


def _images_of(
    batch: EncodedBatch, pieces: tuple[torch.Tensor, ...], rows: list[int]
) -> EncodedBatch:
    """The batch with only the images at `rows` (its text unchanged: the tower reads only
    the patches and the grid)."""
    assert batch.image_grid_thw is not None
    return dataclasses.replace(
        batch,
        patches=torch.cat([pieces[r] for r in rows]),
        image_grid_thw=batch.image_grid_thw[rows],
        image_keys=(),
    )
