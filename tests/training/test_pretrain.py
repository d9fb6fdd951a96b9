"""Grounding pretraining: the attention-supervision term, its targets, and both tiny
architectures through the real pretraining loss."""

import random

import pytest
import torch

from core.policy import load_policy
from training.pretrain_io import (
    attention_supervision_loss,
    bc_batch_loss_cached,
    target_image_tokens,
)
from training.synthetic import box_sample, make_sample
from training.tiny_policy import TINY_GEOMETRY, build_tiny_policy


def test_target_tokens_are_the_28px_cells_the_box_overlaps():
    # 160x210 -> 168x224 model px: 6 columns x 8 rows of 28 px cells; sx = 1.05, sy = 224/210.
    assert target_image_tokens(box_sample((0, 0, 10, 10)), geometry=TINY_GEOMETRY) == [0]
    # x 30..50 -> 31.5..52.5 (column 1); y 90..100 -> 96.0..106.7 (row 3): token 3*6+1.
    assert target_image_tokens(box_sample((30, 90, 50, 100)), geometry=TINY_GEOMETRY) == [19]
    # y 100..110 -> 106.7..117.3 crosses into row 4 (from 112 px): tokens 19 and 25.
    assert target_image_tokens(box_sample((30, 100, 50, 110)), geometry=TINY_GEOMETRY) == [19, 25]
    # Straddling two columns and two rows: 4 tokens.
    assert target_image_tokens(box_sample((20, 20, 40, 40)), geometry=TINY_GEOMETRY) == [0, 1, 6, 7]


def test_attention_loss_is_minus_log_of_the_mass_on_the_target():
    pad, bs, be = 7, 3, 4
    # Row: text, 4 image tokens (positions 1..4), box_start at 5, two point tokens, box_end.
    ids = torch.tensor([[9, pad, pad, pad, pad, bs, 11, 12, be]])
    attn = torch.zeros(1, 9, 9)
    attn[0, 5, 2] = 0.5  # query 5 (box_start) puts half its mass on image token 1
    attn[0, 6, 2], attn[0, 6, 3] = 0.2, 0.05  # query 6: 0.2 on token 1, 0.05 on token 2
    attn[0, 7, 2] = 1.0
    loss = attention_supervision_loss(
        attn, ids, offset=0, targets=[[1]], image_pad=pad, box_start=bs, box_end=be
    )
    expected = -(torch.log(torch.tensor(0.5)) + torch.log(torch.tensor(0.2)) + 0.0) / 3
    assert loss.item() == pytest.approx(expected.item(), abs=1e-4)
    # Two target tokens sum their mass; the query offset shifts rows of `attentions`.
    both = attention_supervision_loss(
        attn[:, 5:], ids, offset=5, targets=[[1, 2]], image_pad=pad, box_start=bs, box_end=be
    )
    expected = -(torch.log(torch.tensor(0.5)) + torch.log(torch.tensor(0.25)) + 0.0) / 3
    assert both.item() == pytest.approx(expected.item(), abs=1e-4)
    # A point shown earlier in the prompt (the system prompt's format example) is not it.
    shown = torch.tensor([[bs, 5, be, 9, pad, pad, pad, pad, bs, 11, 12, be]])
    attn_shown = torch.zeros(1, 12, 12)
    attn_shown[0, 8:11, 5] = 0.5  # the response's queries: half their mass on image token 1
    assert attention_supervision_loss(
        attn_shown, shown, offset=0, targets=[[1]], image_pad=pad, box_start=bs, box_end=be
    ).item() == pytest.approx(-torch.log(torch.tensor(0.5)).item(), abs=1e-4)
    # A row without a point contributes nothing (no NaN from an empty mean) ...
    two = attention_supervision_loss(
        torch.cat([attn, attn]), torch.cat([ids, torch.tensor([[9, pad, pad, pad, pad, 9, 9, 9, 9]])]),
        offset=0, targets=[[1], [1]], image_pad=pad, box_start=bs, box_end=be,
    )  # fmt: skip
    assert two.item() == pytest.approx(loss.item(), abs=1e-6)
    # ... but when no row has one, the supervision is not silently 0.
    with pytest.raises(ValueError, match="none has a point"):
        attention_supervision_loss(
            attn, ids[:, :5], offset=0, targets=[[1]], image_pad=pad, box_start=bs, box_end=be
        )
    assert (
        attention_supervision_loss(
            attn, ids[:, :5], offset=0, targets=[[]], image_pad=pad, box_start=bs, box_end=be
        ).item()
        == 0.0
    )


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_one_supervised_step_moves_the_head_towards_the_target(arch, tmp_path):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    policy = load_policy(build_tiny_policy(tmp_path / arch, arch=arch))
    assert policy.model.config.model_type == arch
    policy.model.set_attn_implementation("eager")
    batch = [make_sample(random.Random(i)) for i in range(4)]
    optimizer = torch.optim.SGD(policy.model.parameters(), lr=0.5)

    def attention_only() -> torch.Tensor:
        bc = bc_batch_loss_cached(policy, batch, coords="pixel", geometry=TINY_GEOMETRY)
        both = bc_batch_loss_cached(
            policy, batch, coords="pixel", geometry=TINY_GEOMETRY, attention_weight=1.0
        )
        return both - bc

    before = attention_only()
    assert before.item() > 0.5  # an untrained head barely looks at the target
    optimizer.zero_grad()
    before.backward()
    optimizer.step()
    assert attention_only().item() < before.item()


def test_attention_supervision_without_eager_attention_is_a_clear_error(tmp_path):
    policy = load_policy(build_tiny_policy(tmp_path / "p"))
    policy.model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="eager attention"):
        bc_batch_loss_cached(
            policy,
            [make_sample(random.Random(0))],
            coords="pixel",
            geometry=TINY_GEOMETRY,
            attention_weight=1.0,
        )


def test_cached_loss_equals_the_plain_loss_even_when_every_row_shares_the_instruction(tmp_path):
    from training.pretrain_io import bc_batch_loss

    torch.set_num_threads(1)
    policy = load_policy(build_tiny_policy(tmp_path / "p"))
    same = [box_sample((10, 60, 40, 80)), box_sample((90, 120, 130, 140))]  # the same instruction
    mixed = [make_sample(random.Random(i)) for i in range(3)]
    for batch in (same, mixed):
        kw = {"coords": "pixel", "geometry": TINY_GEOMETRY}
        with torch.no_grad():
            plain = bc_batch_loss(policy, batch, **kw)
            cached = bc_batch_loss_cached(policy, batch, **kw)
        assert cached.item() == pytest.approx(plain.item(), rel=1e-4)


def test_scene_weights_steer_which_desktop_screens_a_batch_draws(tmp_path, monkeypatch):
    import training.pretrain as module
    from training.pretrain import PretrainConfig, pretrain

    drawn: list[str] = []
    real = module.make_step

    def recording(rng, *, scene=None):
        step = real(rng, scene=scene)
        drawn.append(step.source)
        return step

    monkeypatch.setattr(module, "make_step", recording)
    small = {"hidden": 64, "layers": 1, "heads": 2, "kv_heads": 1, "intermediate": 128}
    config = PretrainConfig(
        max_steps=2, minutes=5, batch_size=4, miniwob_fraction=0, desktop_fraction=1,
        desktop_scenes="drag:1,terminal:0", eval_samples=1, eval_every=1000, threads=1,
        vision_hidden=32, vision_depth=1, **small,
    )  # fmt: skip
    pretrain(config=config, out_dir=tmp_path / "out", log=lambda line: None)
    held_out, trained = drawn[:1], drawn[1:]
    assert len(trained) == 8 and set(trained) == {"desktop/drag"}, drawn
    assert held_out[0].startswith("desktop/")  # the held-out draw is unweighted


def test_bad_scene_weights_say_which_part_is_wrong():
    from training.pretrain import scene_weights
    from training.synthetic_desktop import SCENES

    assert scene_weights("") == {name: 1.0 for name in SCENES}
    assert scene_weights("pad:3, drag") == {"pad": 3.0, "drag": 1.0}
    with pytest.raises(ValueError, match=r"scene 'pads' in 'pads:2' is unknown; expected one of"):
        scene_weights("pads:2")
    with pytest.raises(ValueError, match=r"weight 'pad:-1' in 'drag:1,pad:-1': need a number >= 0"):
        scene_weights("drag:1,pad:-1")
    with pytest.raises(ValueError, match=r"weight 'pad:x'"):
        scene_weights("pad:x")
    with pytest.raises(ValueError, match=r"weights 'pad:0' are all 0"):
        scene_weights("pad:0")


def test_the_pretrain_command_refuses_bad_scene_weights_before_training(tmp_path):
    from django.core.management import CommandError, call_command

    out = tmp_path / "policy"
    with pytest.raises(CommandError, match=r"--desktop-scenes: desktop scene 'pads' in 'pads:2'"):
        call_command("pretrain_policy", "--out", str(out), "--desktop-scenes", "pads:2",
                     "--desktop-fraction", "1", "--miniwob-fraction", "0")  # fmt: skip
    assert not out.exists()
