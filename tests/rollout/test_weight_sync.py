"""New versions pulled over torch.distributed (gloo) from the trainer's weight server
(`training.weight_server` -> `rollout.weight_receive`): the weights equal the checkpoint's
bit for bit, a sync under load drains nobody and fails no request, a pull that breaks off
or does not give the published tag changes nothing, and a sync whose weight server is gone
loads every worker from the checkpoint, trying that server once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

from core.encoding import encode_prompt_response
from core.generation import sequence_logprobs
from core.policy import Policy, install_weights, load_policy, load_weights_into
from core.weight_wire import WeightSource, WireError, WireMismatch
from rollout.client import RouterAdmin
from rollout.weight_receive import WeightReceiver
from tests.helpers import free_port, needs, wait_until
from tests.rollout.test_router import (
    ADMIN,
    AUTH,
    MESSAGES,
    ROOT,
    ClientLoops,
    replay_active_counts,
    start_process,
    stop_process,
)
from training.config import TrainerConfig
from training.trainer import PolicyTrainer
from training.weight_server import WeightServer


@pytest.fixture
def weight_server() -> Iterator[WeightServer]:
    server = WeightServer(host="127.0.0.1", timeout_s=30, window_bytes=1 << 20)
    yield server
    server.close()


def pulled_into(policy: Policy, source: WeightSource) -> Policy:
    receiver = WeightReceiver(timeout_s=30)
    receiver.load(policy=policy, weights=source, swap=lambda s: install_weights(policy, s))
    return policy


def assert_same_weights(a: Policy, b: Policy) -> None:
    left, right = a.model.state_dict(), b.model.state_dict()
    assert left.keys() == right.keys()
    differ = [
        k for k in left if not torch.equal(left[k], right[k]) or left[k].dtype != right[k].dtype
    ]
    assert differ == [], f"{len(differ)} of {len(left)} tensors differ, e.g. {differ[:3]}"


def perturbed(trainer: PolicyTrainer, *, only: str = "") -> None:
    """Move the trainer's weights (those whose name holds `only`) far from where they were."""
    with torch.no_grad():
        for name, p in trainer.policy.model.named_parameters():
            if only in name and p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)


def test_full_weights_pulled_equal_the_checkpoints_bit_for_bit(
    checkpoints, tmp_path, weight_server
):
    torch.manual_seed(0)
    trainer = PolicyTrainer(
        config=TrainerConfig(kl_coef=0.0), start_checkpoint=checkpoints[0], run_dir=tmp_path
    )
    perturbed(trainer)
    saved = trainer.save_version(1)
    kind, tensors = trainer.served_weights()
    source = weight_server.publish(
        version=1, kind=kind, tensors=tensors, dtype=trainer.served_dtype
    )
    perturbed(trainer)  # the trainer trains on: the pull still gets what was published

    pulled = pulled_into(load_policy(checkpoints[0]), source)
    from_file = load_policy(checkpoints[0])
    load_weights_into(from_file, saved)
    assert_same_weights(pulled, from_file)
    assert_same_weights(pulled, load_policy(saved))
    # A worker serving bf16 casts the float32 it receives as from_pretrained casts the file.
    pulled = pulled_into(load_policy(checkpoints[0], dtype=torch.bfloat16), source)
    assert_same_weights(pulled, load_policy(saved, dtype=torch.bfloat16))
    assert [r.outcome for r in weight_server.pulls] == ["verified", "verified"]


def test_bf16_weights_are_refused_by_a_float32_worker(checkpoints, weight_server):
    trained = load_policy(checkpoints[1])
    source = weight_server.publish(
        version=1,
        kind="full",
        tensors=dict(trained.model.named_parameters()),
        dtype=torch.bfloat16,
    )
    worker = load_policy(checkpoints[0])
    with pytest.raises(WireMismatch, match=r"this worker serves torch\.float32"):
        WeightReceiver(timeout_s=30).pull(source, policy=worker, worker="test")
    assert_same_weights(worker, load_policy(checkpoints[0]))


def test_lora_adapters_pulled_equal_the_checkpoints_bit_for_bit(checkpoints, weight_server):
    run_dir = checkpoints[0].parent / "lora-pull-run"  # beside the base
    torch.manual_seed(1)
    trainer = PolicyTrainer(
        config=TrainerConfig(lr=1e-3, kl_coef=0.0, lora_rank=4, lora_alpha=8),
        start_checkpoint=checkpoints[0],
        run_dir=run_dir,
    )
    perturbed(trainer, only="lora_B")
    first = trainer.save_version(1)
    worker = load_policy(first)  # the first adapter comes by checkpoint
    perturbed(trainer, only="lora_")
    second = trainer.save_version(2)
    kind, tensors = trainer.served_weights()
    assert kind == "adapter" and all("lora_" in n for n in tensors)
    source = weight_server.publish(
        version=2, kind=kind, tensors=tensors, dtype=trainer.served_dtype
    )
    assert weight_server.pulls == []
    pulled = pulled_into(worker, source)

    from_file = load_policy(first)
    load_weights_into(from_file, second)
    assert_same_weights(pulled, from_file)
    assert_same_weights(pulled, load_policy(second))
    # Adapters travel alone, not the model.
    adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    model_bytes = sum(p.numel() * p.element_size() for p in pulled.model.parameters())
    assert adapter_bytes <= weight_server.pulls[0].bytes <= adapter_bytes + 64 * len(tensors)
    assert adapter_bytes < model_bytes / 5
    # A worker serving the base only cannot take an adapter over the wire (it has no
    # modules for it): it is told so, and loads the adapter's checkpoint instead.
    with pytest.raises(WireMismatch, match="holds no adapter"):
        WeightReceiver(timeout_s=30).pull(source, policy=load_policy(checkpoints[0]), worker="t")


def test_a_pull_without_the_versions_key_is_refused(checkpoints, weight_server):
    trained = load_policy(checkpoints[1])
    source = weight_server.publish(
        version=1, kind="full", tensors=dict(trained.model.named_parameters())
    )
    worker = load_policy(checkpoints[0])
    forged = WeightSource(source.host, source.port, 1, source.tag, "a" * 43)
    with pytest.raises(WireError, match="proof does not match this version's key"):
        WeightReceiver(timeout_s=30).pull(forged, policy=worker, worker="test")
    older = WeightSource(source.host, source.port, 0, source.tag, source.key)
    with pytest.raises(WireError, match="version 0 is not served; the newest is 1"):
        WeightReceiver(timeout_s=30).pull(older, policy=worker, worker="test")
    assert_same_weights(worker, load_policy(checkpoints[0]))


def test_a_changed_byte_is_refused(checkpoints, weight_server):
    trained = load_policy(checkpoints[1])
    source = weight_server.publish(
        version=1, kind="full", tensors=dict(trained.model.named_parameters())
    )
    # What another party reaching the store or a socket could do: change the bytes sent.
    weight_server._current.buffer[12345] ^= 0x01  # type: ignore[union-attr]
    worker = load_policy(checkpoints[0])
    with pytest.raises(WireError, match=r"but the trainer published .*: not installed"):
        WeightReceiver(timeout_s=30).pull(source, policy=worker, worker="test")
    assert_same_weights(worker, load_policy(checkpoints[0]))
    wait_until(lambda: weight_server.pulls, what="the server's record of the pull")
    assert weight_server.pulls[0].outcome == "refused: tag mismatch"
    # The same bytes put back are taken: the tag refused the change, nothing else.
    weight_server._current.buffer[12345] ^= 0x01  # type: ignore[union-attr]
    pulled_into(worker, source)
    assert_same_weights(worker, trained)


# --------------------------------------------------------------- a real worker


def score_gap(policies: dict[int, Policy], completion) -> float:
    """Largest gap between a reply's log-probs and its version's own scoring of its tokens."""
    policy = policies[completion.policy_version]
    batch, mask = encode_prompt_response(policy, MESSAGES, token_ids=completion.token_ids)
    with torch.no_grad():
        values, _, _ = sequence_logprobs(policy, batch)
    local = values[mask].tolist()
    return max(abs(a - b) for a, b in zip(local, completion.token_logprobs, strict=True))


def test_syncs_from_the_weight_server_under_8_clients_drain_nobody(
    cluster, checkpoints, weight_server
):
    policies = {0: load_policy(checkpoints[0]), 1: load_policy(checkpoints[1])}
    policies[2] = policies[0]  # v2 goes back to v0's weights: two swaps per worker
    admin = RouterAdmin(cluster.router)
    # Replies long enough that a swap landing inside a batch would show in its log-probs.
    with ClientLoops(cluster.router, n=8, max_tokens=24) as loops:
        wait_until(lambda: loops.each_has(1), what="first answers")
        seq_before = max(
            e["seq"] for e in httpx.get(f"{cluster.router}/admin/events", headers=ADMIN).json()
        )
        for version, checkpoint in ((1, checkpoints[1]), (2, checkpoints[0])):
            tensors = dict(policies[version].model.named_parameters())
            source = weight_server.publish(version=version, kind="full", tensors=tensors)
            admin.sync(str(checkpoint), version, weights=source)
            admin.wait_for_version(version, timeout=90)
            t_done = time.monotonic()
            wait_until(lambda t=t_done: loops.each_has(2, after=t), what="answers after a sync")

    assert loops.errors == []
    calls = loops.all()
    assert {c.completion.policy_version for c in calls} == {0, 1, 2}
    # Every reply's version is the weights it was generated with.
    gaps = [score_gap(policies, c.completion) for c in calls]
    assert max(gaps) < 1e-3, sorted(gaps)[-5:]
    # Nobody was drained or taken out of rotation: both workers stayed active throughout,
    # and each swapped both versions in from the weight server.
    events = httpx.get(f"{cluster.router}/admin/events", headers=ADMIN).json()
    since = [e for e in events if e["seq"] > seq_before]
    assert [e for e in since if e["status"] in ("draining", "loading")] == []
    assert min(replay_active_counts(events, since_seq=seq_before + 1)) == 2
    swapped = [e for e in since if e["status"] == "swapped"]
    assert sorted(e["worker"] for e in swapped) == sorted(cluster.workers * 2)
    assert all("from the weight server" in e["detail"] for e in swapped)
    assert [r.outcome for r in weight_server.pulls] == ["verified"] * 4
    admin.close()


SENDER = textwrap.dedent(
    """
    import json, os, signal, sys
    from core.policy import load_policy
    from training.weight_server import WeightServer

    class DiesMidway(WeightServer):
        def _send_window(self, group, window, index):
            if index == int(sys.argv[2]):  # windows sent before it, then the process is gone
                os.kill(os.getpid(), signal.SIGKILL)
            super()._send_window(group, window, index)

    model = load_policy(sys.argv[1]).model
    server = DiesMidway(host="127.0.0.1", timeout_s=30, window_bytes=1 << 20)
    source = server.publish(version=1, kind="full", tensors=dict(model.named_parameters()))
    print(json.dumps({**source.to_json(), "version": 1}), flush=True)
    sys.stdin.read()
    """
)


def test_a_sync_whose_weight_server_is_gone_loads_the_checkpoint_trying_it_once(
    cluster, checkpoints, weight_server
):
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(checkpoints[1]), "-1"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = json.loads(sender.stdout.readline())  # type: ignore[union-attr]
    gone = WeightSource.from_json(line, version=line["version"])
    sender.kill()  # the trainer's process dies after publishing v1
    sender.wait(timeout=30)
    admin = RouterAdmin(cluster.router)
    seq_before = max(
        e["seq"] for e in httpx.get(f"{cluster.router}/admin/events", headers=ADMIN).json()
    )
    admin.sync(str(checkpoints[1]), 1, weights=gone)
    admin.wait_for_version(1, timeout=90)

    events = httpx.get(f"{cluster.router}/admin/events", headers=ADMIN).json()
    since = [e for e in events if e["seq"] > seq_before]
    # The first worker's pull failed on its one connect, and it loaded the checkpoint; the
    # second went to the checkpoint without trying the server.
    failed = [e for e in since if e["status"] == "pull failed"]
    assert len(failed) == 1, failed
    assert "takes no connection" in failed[0]["detail"]
    assert failed[0]["detail"].endswith("the checkpoint instead")
    swapped = [e for e in since if e["status"] == "swapped"]
    assert sorted(e["worker"] for e in swapped) == sorted(cluster.workers)
    assert all("v1 from the checkpoint" in e["detail"] for e in swapped)
    assert [w.policy_version for w in admin.workers()] == [1, 1]
    greedy = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True}
    served = [
        httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=greedy, timeout=60).json()
        for url in cluster.workers
    ]
    from_file = load_policy(checkpoints[1])
    for answer in served:
        completion_ids = [t["token_id"] for t in answer["choices"][0]["logprobs"]["content"]]
        batch, mask = encode_prompt_response(from_file, MESSAGES, token_ids=completion_ids)
        with torch.no_grad():
            values, _, _ = sequence_logprobs(from_file, batch)
        local = values[mask].tolist()
        served_lp = [t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]]
        assert max(abs(a - b) for a, b in zip(local, served_lp, strict=True)) < 1e-3

    # A server published again is tried again: v2 comes over the wire to both.
    tensors = dict(load_policy(checkpoints[0]).model.named_parameters())
    source = weight_server.publish(version=2, kind="full", tensors=tensors)
    admin.sync(str(checkpoints[0]), 2, weights=source)
    admin.wait_for_version(2, timeout=90)
    events = httpx.get(f"{cluster.router}/admin/events", headers=ADMIN).json()
    swapped = [e for e in events if e["status"] == "swapped" and "v2 " in e["detail"]]
    assert len(swapped) == 2
    assert all("from the weight server" in e["detail"] for e in swapped)
    assert [r.outcome for r in weight_server.pulls] == ["verified"] * 2
    admin.close()


@pytest.fixture
@needs("live")
def worker(checkpoints) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_process(
        ["rollout.server", "--policy", str(checkpoints[0]), "--port", str(port), "--threads", "1"],
        health_url=f"{url}/health",
    )
    yield url
    stop_process(proc)


def test_a_pull_whose_sender_dies_midway_leaves_the_worker_on_its_version(
    worker, checkpoints, weight_server
):
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(checkpoints[1]), "2"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = json.loads(sender.stdout.readline())  # type: ignore[union-attr]
        source = WeightSource.from_json(line, version=line["version"])
        reply = httpx.post(
            f"{worker}/v1/reload",
            headers=ADMIN,
            timeout=60,
            json={"version": 1, "weights": source.to_json()},
        )
        assert sender.wait(timeout=30) == -9  # it died mid-transfer, as arranged
    finally:
        if sender.poll() is None:
            sender.kill()
    assert reply.status_code == 502, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith("weights not pulled, kept version 0: the pull of version 1")
    health = httpx.get(f"{worker}/health").json()
    assert health["policy_version"] == 0 and health["reloading"] is None
    # It serves v0's weights, and a later pull from a live server goes through.
    greedy = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True}
    answered = httpx.post(
        f"{worker}/v1/chat/completions", headers=AUTH, json=greedy, timeout=60
    ).json()
    assert answered["policy_version"] == 0
    trained = load_policy(checkpoints[1])
    source = weight_server.publish(
        version=1, kind="full", tensors=dict(trained.model.named_parameters())
    )
    reply = httpx.post(
        f"{worker}/v1/reload",
        headers=ADMIN,
        timeout=60,
        json={"version": 1, "weights": source.to_json()},
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["policy_version"] == 1 and body["source"] == "weights"
    assert body["bytes"] == weight_server.pulls[-1].bytes > 0
    assert httpx.get(f"{worker}/health").json()["policy_version"] == 1
