"""A trainer state file is data: one that carries code is refused, not run, on resume."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

from training.config import TrainerConfig
from training.trainer import STATE_FILE, PolicyTrainer, version_dir


class _RunsCode:
    """Unpickling this calls os.system: what a planted state file would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_state_file_that_carries_code_is_refused(tiny_policy_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    settings = TrainerConfig(lr=1e-4, kl_coef=0.0)
    trainer = PolicyTrainer(config=settings, start_checkpoint=tiny_policy_dir, run_dir=run_dir)
    published = trainer.save_version(1)
    marker = tmp_path / "code-ran"
    with open(published / STATE_FILE, "wb") as f:
        pickle.dump({"optimizer": _RunsCode(str(marker)), "updates": 1, "version": 1}, f)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        PolicyTrainer(
            config=settings,
            start_checkpoint=tiny_policy_dir,
            run_dir=run_dir,
            published_versions=[1],
        )
    assert not marker.exists()
    shutil.rmtree(version_dir(run_dir, 1))
