"""The trainer's learning rate is the schedule's (`TrainerConfig.lr_at`), set on the optimizer
in one place before every update, and a resumed trainer goes on from its update count."""

from __future__ import annotations

import pytest

from tests.training.test_lora import CURATION, samples
from training.config import TrainerConfig
from training.trainer import PolicyTrainer

pytestmark = pytest.mark.slow  # trains the tiny policy

# Warm-up over 2 updates to 1e-4, then a linear decay to 5e-5 over 2 more.
SCHEDULED = TrainerConfig(
    lr=1e-4,
    kl_coef=0.0,
    micro_batch=4,
    lr_warmup_updates=2,
    lr_schedule="linear",
    lr_decay_updates=2,
    lr_min_ratio=0.5,
)


def test_each_update_steps_at_the_schedules_rate_and_a_resumed_trainer_goes_on(
    tiny_policy_dir, tmp_path
) -> None:
    run_dir = tmp_path / "run"
    trainer = PolicyTrainer(config=SCHEDULED, start_checkpoint=tiny_policy_dir, run_dir=run_dir)
    rates = [trainer.update(samples(), CURATION).lr for _ in range(3)]
    assert rates == pytest.approx([5e-5, 1e-4, 1e-4])
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    trainer.save_version(1)
    resumed = PolicyTrainer(
        config=SCHEDULED, start_checkpoint=tiny_policy_dir, run_dir=run_dir, published_versions=[1]
    )
    assert resumed.state.updates == 3
    assert resumed.update(samples(), CURATION).lr == pytest.approx(7.5e-5)
