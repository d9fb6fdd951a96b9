"""The shipped grounded tiny policy (policies/tiny-grounded): present, small, documented by
its manifest, loadable, and it clicks on the target of screens it never saw."""

import json
import random
from pathlib import Path

import pytest
import torch

from core.imaging import ImageGeometry
from core.policy import load_policy
from training.pretrain_io import grounding_accuracy
from training.synthetic import make_sample
from training.tiny_policy import TINY_GEOMETRY

pytestmark = pytest.mark.slow  # trains or loads a policy: 6-35 s a test

SHIPPED = Path(__file__).resolve().parents[2] / "policies" / "tiny-grounded"


@pytest.fixture(scope="module")
def shipped():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_policy(SHIPPED)
    torch.set_num_threads(threads)


def test_the_checkpoint_is_small_and_its_manifest_says_how_it_was_made():
    weights = sum(p.stat().st_size for p in SHIPPED.glob("*.safetensors"))
    assert 0 < weights <= 25 * 1024 * 1024
    manifest = json.loads((SHIPPED / "MANIFEST.json").read_text())
    assert manifest["command"].startswith("python manage.py pretrain_policy")
    assert isinstance(manifest["seed"], int)
    assert manifest["data"]["miniwob_clicks"] > 0
    assert manifest["data"]["miniwob_seeds"].startswith("100000..")  # bench seeds stay below
    assert manifest["config"]["attention_supervision"] > 0
    assert manifest["steps"] > 0 and manifest["weights_bytes"] == weights


def test_it_loads_as_qwen3_vl_and_clicks_on_unseen_screens(shipped):
    assert shipped.model.config.model_type == "qwen3_vl"
    # Synthetic screens from a seed no training batch drew (the pretraining uses seed 0's
    # stream; its held-out set uses 10_000_019).
    screens = [make_sample(random.Random(424_242 + i)) for i in range(32)]
    figures = grounding_accuracy(shipped, screens, coords="pixel", geometry=TINY_GEOMETRY)
    assert figures["parse_rate"] == 1.0
    # A random click lands in a synthetic target ~3% of the time (their mean share of the
    # screen); the untrained policy never produces a click at all.
    assert figures["accuracy"] >= 0.25, figures


@pytest.mark.parametrize("name", ["tiny-grounded", "tiny-desktop"])
def test_the_shipped_processors_geometry_is_the_one_tests_and_synthetic_screens_use(name):
    # Tests and the pretraining's synthetic screens take TINY_GEOMETRY; the policies read
    # theirs from preprocessor_config.json. They must be one geometry, or a target "inside
    # its box" in a test is not inside it for the shipped policy.
    assert ImageGeometry.from_policy_dir(SHIPPED.parent / name) == TINY_GEOMETRY


def test_make_run_starts_from_it(settings):
    from datamanager.policies import policy_path

    assert policy_path("shipped") == SHIPPED


# ------------------------------------------------------------------ the desktop policy

SHIPPED_DESKTOP = SHIPPED.parent / "tiny-desktop"


def test_the_desktop_policy_is_small_and_says_it_continued_the_shipped_one_on_desktops():
    weights = sum(p.stat().st_size for p in SHIPPED_DESKTOP.glob("*.safetensors"))
    assert 0 < weights <= 25 * 1024 * 1024
    manifest = json.loads((SHIPPED_DESKTOP / "MANIFEST.json").read_text())
    # The manifest chains each run to the one it continued: the desktop runs, then the
    # shipped policy's own (make policy-desktop's commands, newest first).
    desktop_runs, earlier = [], manifest
    while earlier is not None and "--out policies/tiny-desktop" in earlier["command"]:
        desktop_runs.append(earlier)
        earlier = earlier.get("continued_from")
    assert desktop_runs, manifest["command"]
    assert desktop_runs[-1]["command"].startswith(
        "python manage.py pretrain_policy --init policies/tiny-grounded"
    )
    assert all(run["data"]["desktop_fraction"] > 0 for run in desktop_runs)
    assert earlier is not None and "--out policies/tiny-grounded" in earlier["command"]
    assert sum(run["seconds"] for run in desktop_runs) <= 60 * 60  # about an hour on 2 cores


def test_the_desktop_policy_acts_on_unseen_synthetic_desktops(settings):
    from datamanager.policies import policy_path
    from training.synthetic_desktop import make_episode

    assert policy_path("shipped-desktop") == SHIPPED_DESKTOP  # make run-desktop starts here
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policy = load_policy(SHIPPED_DESKTOP)
        # Episodes from seeds the pretraining never drew (its stream is seed 0's).
        steps = [s for i in range(12) for s in make_episode(random.Random(525_252 + i))]
        figures = grounding_accuracy(policy, steps, coords="pixel", geometry=policy.image_geometry)
        shipped = grounding_accuracy(
            load_policy(SHIPPED), steps, coords="pixel", geometry=policy.image_geometry
        )
    finally:
        torch.set_num_threads(threads)
    assert figures["parse_rate"] >= 0.9, figures
    # The MiniWoB-only policy gets almost none of these steps right (it only ever clicks).
    assert figures["accuracy"] >= shipped["accuracy"] + 0.3, (figures, shipped)
