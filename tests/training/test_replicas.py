"""Two data-parallel trainer replicas take the same update as one process: this process
leads (`ReplicaGroup.start`) and a real follower process takes every step with it over gloo
on the loopback device; full fine-tuning and LoRA on the tiny policy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.training.test_lora import CURATION, LORA, SETTINGS, samples
from training.replica_group import ReplicaGroup, TrainerSpec

pytestmark = pytest.mark.slow

# fp32, only the order of the gradient sums differs. Adam turns that into differences of up
# to 5e-4 in single elements after two steps of lr 1e-2 (an element whose gradient is near
# zero takes a step of about lr whatever its sign); per tensor, the difference is under 2e-4
# of how far the tensor moved (measured on this session's machine; an earlier machine had
# 1.6e-5 at most per element). A lost or doubled share shows in the loss and grad norm.
TOLERANCE = 1e-3  # per tensor: |got - expected| / |expected - start|
ELEMENT_TOLERANCE = 5e-3  # any one element, against moves of ~1e-2


def _same_weights(got: dict, expected: dict, start: dict) -> None:
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        diff = got[name].detach() - want.detach()
        assert diff.abs().max().item() < ELEMENT_TOLERANCE, name
        if "lora_A" in name:  # fresh adapters' A matrices are random: no common start
            continue
        moved = (want.detach() - start[name].detach()).norm().item()
        assert diff.norm().item() <= TOLERANCE * moved + 1e-9, (name, diff.norm().item(), moved)


REPLICATED = dataclasses.replace(SETTINGS, micro_batch=2)  # 4 micro-batches: 2 per replica


def _seen(metrics) -> tuple[float, float]:
    """What an update reports that would show a lost or doubled share: loss and grad norm
    (AdamW's step barely changes with a gradient's scale; the norm does)."""
    return metrics.loss, metrics.grad_norm


def batch() -> list:
    return [*samples(0), *samples(1)]  # eight steps in four groups


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_two_replicas_take_the_one_process_step(tiny_policy_dir, tmp_path, mode) -> None:
    def spec(name: str) -> TrainerSpec:
        return TrainerSpec(
            config=dataclasses.replace(REPLICATED, **(LORA if mode == "lora" else {})),
            start_checkpoint=str(tiny_policy_dir),
            run_dir=str(tmp_path / name),
        )

    torch.manual_seed(1)
    alone = spec("alone").build(None, device="cpu")
    losses = [_seen(alone.update(batch(), CURATION)) for _ in range(2)]
    expected = {n: p.detach().clone() for n, p in alone.policy.model.named_parameters()}

    torch.manual_seed(1)  # the leader's fresh adapters are the ones every replica takes
    group = ReplicaGroup.start(spec("replicas"), world=2)
    try:
        got_losses = [_seen(group.trainer.update(batch(), CURATION)) for _ in range(2)]
        got = dict(group.trainer.policy.model.named_parameters())
    finally:
        group.close()
    assert [p.returncode for p in group.followers] == [0]
    # Each replica computed half the micro-batches: the summed losses are the whole's (had
    # each done all of them, they would be twice as large).
    assert [g for pair in got_losses for g in pair] == pytest.approx(
        [x for pair in losses for x in pair], rel=1e-4
    )
    start = dict(spec("start").build(None, device="cpu").policy.model.named_parameters())
    _same_weights(got, expected, start)
    moved = max(
        (expected[n] - p).abs().max().item()
        for n, p in start.items()
        if "lora_A" not in n  # fresh adapters' A matrices are random, not trained
    )
    assert moved > 100 * 1e-4  # equality is not two untouched copies


def test_sharded_replicas_save_and_resume_as_one_process(tiny_policy_dir, tmp_path) -> None:
    """FSDP2 over two replicas (full fine-tuning): the saved version equals the one-process
    weights, and resuming from it (each replica keeps its shard of the saved optimizer
    state) continues as the one process does."""

    def spec(name: str, published: list[int] | None = None, shard: bool = True) -> TrainerSpec:
        return TrainerSpec(config=dataclasses.replace(REPLICATED, replicas=2 if shard else 1,
                                                      shard=shard),
                           start_checkpoint=str(tiny_policy_dir), run_dir=str(tmp_path / name),
                           published_versions=published or [])  # fmt: skip

    alone = spec("alone", shard=False).build(None, device="cpu")
    start = {n: p.detach().clone() for n, p in alone.policy.model.named_parameters()}
    losses = [_seen(alone.update(batch(), CURATION)) for _ in range(2)]
    after_two = {n: p.detach().clone() for n, p in alone.policy.model.named_parameters()}
    losses.append(_seen(alone.update(batch(), CURATION)))
    group = ReplicaGroup.start(spec("sharded"), world=2)
    try:
        got = [_seen(group.trainer.update(batch(), CURATION)) for _ in range(2)]
        saved = group.trainer.save_version(2)
    finally:
        group.close()
    resumed = ReplicaGroup.start(spec("sharded", published=[2]), world=2)
    try:
        assert resumed.trainer.state.version == 2
        got.append(_seen(resumed.trainer.update(batch(), CURATION)))
        final = resumed.trainer.save_version(3)
    finally:
        resumed.close()
    assert [g for pair in got for g in pair] == pytest.approx(
        [x for pair in losses for x in pair], rel=1e-4
    )
    after_three = dict(alone.policy.model.named_parameters())
    for version_dir, expected in ((saved, after_two), (final, after_three)):
        check = dataclasses.replace(spec("check", shard=False), start_checkpoint=str(version_dir))
        weights = dict(check.build(None, device="cpu").policy.model.named_parameters())
        _same_weights(weights, expected, start)


def test_a_group_whose_follower_died_can_be_left_and_started_again(tiny_policy_dir, tmp_path):
    """A dead follower fails the update (the error reaches the caller); leaving the broken
    group still works, so the worker's next trainer can start a new one."""
    spec = TrainerSpec(config=REPLICATED, start_checkpoint=str(tiny_policy_dir),
                       run_dir=str(tmp_path / "run"))  # fmt: skip
    group = ReplicaGroup.start(spec, world=2)
    group.followers[0].kill()
    group.followers[0].wait()
    with pytest.raises(RuntimeError):
        group.trainer.update(batch(), CURATION)
    group.close()
    assert not torch.distributed.is_initialized()
    again = ReplicaGroup.start(spec, world=2)
    try:
        assert again.trainer.update(batch(), CURATION).optimizer_steps == 1
    finally:
        again.close()
    assert [p.returncode for p in again.followers] == [0]


def test_followers_wait_for_the_first_batch_longer_than_a_collective_may(
    tiny_policy_dir, tmp_path, monkeypatch
):
    """A run's first batch can take longer than a collective's timeout (OSWorld episodes and
    the version-0 evaluation against NCCL's 10 minutes): here 8 s on gloo, and the leader
    has its batch after 20 s. The followers wait outside any collective and the update runs.
    What goes through the collective names the batch's file, not its screenshots."""
    import time

    from training.replicas import Replicas

    shared: list = []
    share = Replicas.share

    def recording_share(self, value):
        shared.append(value)
        return share(self, value)

    monkeypatch.setattr(Replicas, "share", recording_share)
    spec = TrainerSpec(config=REPLICATED, start_checkpoint=str(tiny_policy_dir),
                       run_dir=str(tmp_path / "run"))  # fmt: skip
    group = ReplicaGroup.start(spec, world=2, timeout_s=8.0)
    try:
        time.sleep(20.0)  # the trainer waits for its first ready groups
        assert group.trainer.update(batch(), CURATION).optimizer_steps == 1
    finally:
        group.close()
    assert [p.returncode for p in group.followers] == [0]
    kind, batch_file, _, _, updates = shared[0]
    assert updates == 0  # the follower's schedule starts where the leader's does
    assert kind == "update" and batch_file.endswith("update-1.jsonl")
    assert "data:image" not in repr(shared[0])
    assert not list((tmp_path / "run" / ".replica-batches").glob("*.jsonl"))  # removed after


def _join(port: int, *, rank: int = 1, world: int = 2):
    """A follower as another host's agent starts it: torchrun's environment, the trainer's
    settings read from the leader's store."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world)}  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "training.replica_group", "join"], env=env)


def test_sharded_replicas_that_join_at_a_rendezvous_take_the_one_process_step(
    tiny_policy_dir, tmp_path
) -> None:
    """Replicas on two hosts: the leader's store at the rendezvous the placement gave it,
    a follower that knows only that address (its settings from the store, the batch in the
    collective, no file between them), FSDP2 over gloo: the same step as one process."""
    from tests.helpers import free_port

    def spec(name: str, shard: bool = True) -> TrainerSpec:
        return TrainerSpec(config=dataclasses.replace(REPLICATED, replicas=2 if shard else 1,
                                                      shard=shard),
                           start_checkpoint=str(tiny_policy_dir), run_dir=str(tmp_path / name))  # fmt: skip

    alone = spec("alone", shard=False).build(None, device="cpu")
    start = {n: p.detach().clone() for n, p in alone.policy.model.named_parameters()}
    losses = [_seen(alone.update(batch(), CURATION)) for _ in range(2)]
    port = free_port()
    follower = _join(port)
    group = ReplicaGroup.start(spec("spread"), world=2, rendezvous=f"127.0.0.1:{port}")
    try:
        got = [_seen(group.trainer.update(batch(), CURATION)) for _ in range(2)]
        saved = group.trainer.save_version(2)
    finally:
        group.close()
    assert follower.wait(timeout=60) == 0
    assert not (tmp_path / "spread" / ".replica-batches").exists()  # the batch went in the group
    assert [g for pair in got for g in pair] == pytest.approx(
        [x for pair in losses for x in pair], rel=1e-4
    )
    check = dataclasses.replace(spec("check", shard=False), start_checkpoint=str(saved))
    weights = dict(check.build(None, device="cpu").policy.model.named_parameters())
    _same_weights(weights, dict(alone.policy.model.named_parameters()), start)


def test_a_lost_replica_host_ends_the_update_after_the_runs_timeout(tiny_policy_dir, tmp_path):
    """A follower whose host stops answering (its process frozen: no reset, no exit) ends
    the update after the run's `trainer.replica_timeout_s`, which reaches the group's
    collectives, not after NCCL's or gloo's default of 10 or 30 minutes."""
    import os
    import signal
    import time

    from tests.helpers import free_port

    config = dataclasses.replace(REPLICATED, replicas=2, replica_timeout_s=10.0)
    spec = TrainerSpec(config=config, start_checkpoint=str(tiny_policy_dir),
                       run_dir=str(tmp_path / "run"))  # fmt: skip
    port = free_port()
    follower = _join(port)
    group = ReplicaGroup.start(spec, world=2, rendezvous=f"127.0.0.1:{port}")
    try:
        assert group.trainer.update(batch(), CURATION).optimizer_steps == 1
        os.kill(follower.pid, signal.SIGSTOP)
        began = time.monotonic()
        with pytest.raises(RuntimeError):
            group.trainer.update(batch(), CURATION)
        waited = time.monotonic() - began
    finally:
        follower.kill()
        follower.wait()
        group.close(timeout_s=0)
    assert 9.0 <= waited < 30.0, waited  # the run's 10 s and the update's own work
    assert not torch.distributed.is_initialized()
