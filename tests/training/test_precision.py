"""Full fine-tuning in mixed precision: fp32 weights and optimizer moments, bf16 autocast on
GPUs (`training.trainer.trainer_precision`). In pure bf16, as the trainer ran on GPUs before,
an update at lr 1e-5 rounds to nothing on most weights."""

from __future__ import annotations

import pytest
import torch

from tests.training.test_lora import samples
from training.config import CurationConfig, TrainerConfig
from training.trainer import PolicyTrainer, trainer_precision

SETTINGS = TrainerConfig(lr=1e-5, kl_coef=0.0, micro_batch=4)
CURATION = CurationConfig(high_entropy=False, truncated_is=False)


def test_weights_are_fp32_and_only_the_forward_runs_in_bf16_on_a_gpu() -> None:
    assert trainer_precision("cuda", bf16=True) == (torch.float32, torch.bfloat16)
    assert trainer_precision("cuda:1", bf16=False) == (torch.float32, None)
    assert trainer_precision("cpu", bf16=True) == (torch.float32, None)


def _changed_fraction(trainer: PolicyTrainer) -> float:
    """The fraction of the language model's weights one update at lr 1e-5 changes."""
    language = [(n, p) for n, p in trainer.policy.model.named_parameters() if "visual" not in n]
    before = [p.detach().clone() for _, p in language]
    torch.manual_seed(0)
    trainer.update(samples(), CURATION)
    changed = sum(int((p.detach() != b).sum()) for (_, p), b in zip(language, before, strict=True))
    return changed / sum(b.numel() for b in before)


@pytest.mark.slow
def test_one_full_fine_tuning_step_at_lr_1e5_changes_most_weights(tiny_policy_dir, tmp_path):
    trainer = PolicyTrainer(
        config=SETTINGS, start_checkpoint=tiny_policy_dir, run_dir=tmp_path / "run"
    )
    assert {p.dtype for p in trainer.policy.model.parameters()} == {torch.float32}
    mixed = _changed_fraction(trainer)
    # The same step on bf16 weights (the trainer's GPU default before): most updates vanish.
    pure = PolicyTrainer(
        config=SETTINGS, start_checkpoint=tiny_policy_dir, run_dir=tmp_path / "pure"
    )
    pure.policy.model.to(torch.bfloat16)
    pure.optimizer = torch.optim.AdamW(pure.trainable_parameters())  # the trainer sets its lr
    bf16 = _changed_fraction(pure)
    print(f"\nchanged by one step at lr 1e-5: fp32 weights {mixed:.1%}, bf16 weights {bf16:.1%}")
    assert mixed > 0.5 and bf16 < mixed / 4
