"""The frozen vision tower's output per screenshot (`training.image_features`): what the
cache hands the model equals the tower's output over the whole batch, for the shipped
Qwen3-VL policy (with its deepstack features) and a tiny Qwen2.5-VL, and each screenshot
goes through the tower once."""

from __future__ import annotations

import pytest
import torch

from core.encoding import encode_batch
from core.lora import base_model
from core.policy import load_policy
from core.prompts import image_part
from tests.conftest import png_bytes
from training.image_features import ImageFeatures


def _screens() -> list[bytes]:
    return [png_bytes(160, 120, (200, 40, 40)), png_bytes(120, 160, (40, 200, 40)),
            png_bytes(200, 100, (40, 40, 200))]  # fmt: skip  # three screens, one a line


def _steps(screens: list[bytes]) -> list[list[dict]]:
    """Three steps of one episode: each shows the screens so far (the last two)."""
    return [
        [{"role": "user", "content": [{"type": "text", "text": "go"},
                                      *[image_part(s) for s in screens[max(0, k - 1) : k + 1]]]}]
        for k in range(len(screens))
    ]  # fmt: skip  # a message literal


@pytest.fixture(params=["shipped", "qwen2_5_vl"])
def policy(request, tmp_path_factory):
    if request.param == "shipped":
        from datamanager.policies import SHIPPED_POLICY

        return load_policy(SHIPPED_POLICY)
    from training.tiny_policy import build_tiny_policy

    path = build_tiny_policy(tmp_path_factory.mktemp("q25") / "m", arch="qwen2_5_vl", layers=1)
    return load_policy(path)


def _tower(policy, calls: list[int]):
    """The policy's vision tower as the trainer calls it, counting the images of each call."""
    inner = base_model(policy.model).model

    def encode(batch):
        calls.append(len(batch.image_grid_thw))
        with torch.no_grad():
            return inner.get_image_features(
                batch.pixel_values(), batch.image_grid_thw, return_dict=True
            )

    return encode


def test_the_cache_gives_the_towers_own_output_encoding_each_screen_once(policy) -> None:
    encoded: list[int] = []
    encode = _tower(policy, encoded)
    cache = ImageFeatures()
    for step in _steps(_screens()):
        batch = encode_batch(policy, [step])
        assert len(batch.image_keys) == len(batch.image_grid_thw)
        got = cache.of(batch, encode)
        want = encode(batch)
        encoded.pop()  # the reference computation is not the cache's
        assert len(got.pooler_output) == len(want.pooler_output)
        for a, b in zip(got.pooler_output, want.pooler_output, strict=True):
            assert torch.allclose(a, b, atol=1e-5)
        deep = getattr(want, "deepstack_features", None)
        if deep is not None:
            for layer_got, layer_want in zip(got.deepstack_features, deep, strict=True):
                for a, b in zip(layer_got, layer_want, strict=True):
                    assert torch.allclose(a, b, atol=1e-5)
    # Screens 1, 1+2, 2+3: the tower saw each of the three once.
    assert encoded == [1, 1, 1] and (cache.encoded, cache.reused) == (3, 2)


def test_without_keys_the_patches_are_the_key_and_zero_keeps_nothing(policy) -> None:
    import dataclasses

    calls: list[int] = []
    encode = _tower(policy, calls)
    steps = _steps(_screens())
    batches = [dataclasses.replace(encode_batch(policy, [s]), image_keys=()) for s in steps]
    cache = ImageFeatures()
    for batch in batches:
        cache.of(batch, encode)
    assert calls == [1, 1, 1]
    calls.clear()
    off = ImageFeatures(max_images=0)
    for batch in batches:
        off.of(batch, encode)
    assert calls == [1, 2, 2]  # every batch through the tower whole
