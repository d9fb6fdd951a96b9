"""Two data-parallel replicas (real processes, torch.distributed over gloo on the loopback
device) take the same update as one process: full fine-tuning and LoRA on the tiny policy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.lora import LoraSpec
from tests.training.test_lora import CONFIG, samples
from training.replicas import Replicas
from training.trainer import PolicyTrainer

pytestmark = pytest.mark.slow

# fp32, only the order of the gradient sums differs; Adam turns that into ~1e-5 after two
# steps of lr 1e-2 (measured 1.6e-5), against weight moves of ~1e-2.
TOLERANCE = 1e-4


def batch() -> list:
    """Eight steps (four groups): four micro-batches of two, two per replica."""
    return [*samples(0), *samples(1)]


def train(
    policy: Path, run_dir: Path, mode: str, replicas: Replicas | None
) -> tuple[PolicyTrainer, list[float]]:
    torch.manual_seed(1 + (replicas.rank if replicas else 0))  # the leader's adapters win
    trainer = PolicyTrainer(
        start_checkpoint=policy,
        run_dir=run_dir,
        lr=1e-2,
        kl_coef=0.1,
        lora=LoraSpec(rank=4, alpha=8) if mode == "lora" else None,
        replicas=replicas,
    )
    config = CONFIG.__class__(**{**CONFIG.__dict__, "micro_batch": 2})
    losses = [trainer.update(batch(), config).loss for _ in range(2)]
    return trainer, losses


def replica(rank: int, world: int, init: str, policy: str, out: str, mode: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # collectives stay on 127.0.0.1
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        trainer, losses = train(Path(policy), Path(out) / f"run{rank}", mode, Replicas(rank, world))
        weights = {n: p.detach() for n, p in trainer.policy.model.named_parameters()}
        torch.save({"weights": weights, "losses": losses}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_two_replicas_take_the_one_process_step(tiny_policy_dir, tmp_path, mode) -> None:
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        replica,
        args=(2, init, str(tiny_policy_dir), str(tmp_path), mode),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    torch.manual_seed(1)
    alone, losses = train(tiny_policy_dir, tmp_path / "alone", mode, None)
    expected = {n: p.detach() for n, p in alone.policy.model.named_parameters()}
    for result in ranks:
        # Each replica computed half the micro-batches: the summed losses are the whole's
        # (had each done all of them, they would be twice as large).
        assert result["losses"] == pytest.approx(losses, rel=1e-4)
        got = result["weights"]
        assert got.keys() == expected.keys()
        worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
        assert worst < TOLERANCE, worst
    # And the update moved the weights: equality is not two untouched copies.
    if mode == "lora":
        assert max(expected[n].abs().max().item() for n in expected if "lora_B" in n) > 1e-3
    else:
        start = PolicyTrainer(
            start_checkpoint=tiny_policy_dir, run_dir=tmp_path / "s", lr=1e-2, kl_coef=0
        )
        base = dict(start.policy.model.named_parameters())
        moved = max((expected[n] - base[n]).abs().max().item() for n in expected)
        assert moved > 100 * TOLERANCE
