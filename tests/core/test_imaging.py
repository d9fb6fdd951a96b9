"""The image geometry: Qwen-VL's resize rule, and geometry read from a policy's processor."""

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.imaging import QWEN25_VL, ImageGeometry, ProcessorNotSupported


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (210, 160, (224, 168)),  # MiniWoB: 210/28 = 7.5 rounds (half to even) to 8
        (1080, 1920, (1092, 1932)),  # 38.57 -> 39, 68.57 -> 69; 2.1 MP is under the cap
        (42, 1000, (56, 1008)),  # 1.5 -> 2, 35.7 -> 36
        (70, 700, (56, 700)),  # 2.5 rounds to 2 (half to even)
        (20, 30, (56, 84)),  # 28x28 < min_pixels: beta = sqrt(3136/600) = 2.286, ceil
        (
            4000,
            6000,
            (2912, 4368),
        ),  # 24 MP > max: beta = 1.3669, floor(104.5)=104, floor(156.8)=156
    ],
)
def test_resize_known_values(height: int, width: int, expected: tuple[int, int]) -> None:
    assert QWEN25_VL.resize(height, width) == expected


def test_resize_with_the_transformers_processor_default_cap() -> None:
    # Qwen2VLImageProcessor's own default max_pixels is 28*28*1280.
    assert replace(QWEN25_VL, max_pixels=28 * 28 * 1280).resize(1080, 1920) == (728, 1316)


def test_resize_refuses_extreme_aspect_ratios() -> None:
    with pytest.raises(ValueError, match="aspect ratio must be at most 200"):
        QWEN25_VL.resize(10, 2500)


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(min_value=15, max_value=5000),
    width=st.integers(min_value=15, max_value=5000),
    max_pixels=st.sampled_from([16384 * 28 * 28, 28 * 28 * 1280, 200 * 28 * 28]),
)
def test_resize_matches_the_transformers_image_processor(
    height: int, width: int, max_pixels: int
) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as reference,
    )

    if max(height, width) / min(height, width) > 200:
        return
    assert replace(QWEN25_VL, max_pixels=max_pixels).resize(height, width) == reference(
        height, width, min_pixels=4 * 28 * 28, max_pixels=max_pixels
    )


def test_model_size_is_width_then_height() -> None:
    assert QWEN25_VL.model_size(width=1920, height=1080) == (1932, 1092)
    assert QWEN25_VL.model_size(width=160, height=210) == (168, 224)


def test_geometry_comes_from_the_processor_config_in_both_spellings(tmp_path) -> None:
    new = {
        "patch_size": 14,
        "merge_size": 2,
        "size": {"shortest_edge": 3136, "longest_edge": 200704},
    }
    old = {"patch_size": 16, "merge_size": 2, "min_pixels": 4096, "max_pixels": 1048576}
    assert ImageGeometry.from_processor_config(new) == ImageGeometry(28, 3136, 200704)
    assert ImageGeometry.from_processor_config(old) == ImageGeometry(32, 4096, 1048576)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(new))
    assert ImageGeometry.from_policy_dir(tmp_path).model_size(width=800, height=600) == (504, 364)


def test_a_processor_without_bounds_is_refused_with_its_file(tmp_path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(ProcessorNotSupported, match=r"preprocessor_config\.json: not a Qwen-VL"):
        ImageGeometry.from_policy_dir(tmp_path)
    with pytest.raises(ProcessorNotSupported, match="missing"):
        ImageGeometry.from_policy_dir(tmp_path / "nowhere")


def test_a_geometry_builds_the_processor_it_is_read_back_from():
    """Checkpoints built here get their image bounds from `ImageGeometry.processor`; the
    processor's saved config must give the same geometry back."""
    from core.imaging import QWEN25_VL
    from training.tiny_policy import TINY_GEOMETRY

    for geometry in (QWEN25_VL, TINY_GEOMETRY):
        assert ImageGeometry.from_processor_config(geometry.processor().to_dict()) == geometry
