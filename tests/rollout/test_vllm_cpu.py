"""vLLM for real, on this machine's CPU (its CPU build, in `.venv-vllm`): started exactly as
the launcher starts it (`hostagent.launcher.vllm_specs`: vLLM on a unix socket in the home's
0700 run/ directory, its key in VLLM_API_KEY, the adapter in front), serving the shipped
policy. Through the official `openai` client and Dartboard's own: completions with
screenshots and log-probs; parity with the transformers server on the same prompts; a LoRA
switch and a full-weight reload, each under load from 8 clients, with no failed request and
the new weights' log-probs served afterwards; an adapter restarted beside a running vLLM;
full weights and LoRA adapters pulled from the trainer's weight server into vLLM through
the router's sync under 8 clients, with no failed request."""

from __future__ import annotations

import functools
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from django.conf import settings

from core.completion import Completion
from core.encoding import batch_from_parts, prompt_parts
from core.generation import sequence_logprobs
from core.policy import Policy, load_policy
from core.prompt_counter import PromptCounter
from core.prompts import build_messages, decode_image_parts
from core.protocol import TaskSpec
from envmanager.sim_env import SimEnv
from hostagent.launcher import Supervisor, vllm_specs
from rollout.auth import ServiceTokens, bearer
from rollout.client import PolicyClient, RouterAdmin
from rollout.local_server import LocalPolicyServer
from rollout.vllm_command import vllm_missing
from tests.helpers import free_port, needs, wait_until
from tests.rollout.test_router import ADMIN, ClientLoops, start_process, stop_process
from training.config import TrainerConfig
from training.trainer import PolicyTrainer
from training.weight_server import WeightServer

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "policies" / "tiny-grounded"


@dataclass
class VllmStack:
    url: str
    supervisor: Supervisor
    tokens: ServiceTokens


@pytest.fixture(scope="module")
@needs("live")
def vllm_stack() -> Iterator[VllmStack]:
    if missing := vllm_missing():  # `make test` builds it first: a failure, never a skip
        pytest.fail(missing)
    tokens = ServiceTokens(settings.DARTBOARD_INFERENCE_TOKEN, settings.DARTBOARD_ADMIN_TOKEN)
    port = free_port()
    home = Path(settings.DARTBOARD_HOME)
    supervisor = Supervisor(home=home, specs=vllm_specs(0, str(SHIPPED), port, tokens=tokens))
    supervisor.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _models_listed(url, tokens), timeout=240, what="vLLM behind its adapter",
                   interval=1.0)  # fmt: skip
        yield VllmStack(url=url, supervisor=supervisor, tokens=tokens)
    finally:
        supervisor.stop()
        for name in ("vllm-0", "inference-0"):  # kept for a failure's reader: the home goes
            shutil.copy(
                home / "logs" / f"{name}.log",
                Path(tempfile.gettempdir()) / f"dartboard-test-{name}.log",
            )


def _models_listed(url: str, tokens: ServiceTokens) -> bool:
    try:
        r = httpx.get(f"{url}/v1/models", headers=bearer(tokens.inference), timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and bool(r.json().get("data"))


def screens(n: int) -> list[list[dict]]:
    """The Dartboard prompt on `n` synthetic screens (sim click tasks, seeds 0..n-1)."""
    out = []
    for seed in range(n):
        task = TaskSpec(name="sim/click-3", env_kind="sim", env_config={"targets": 3}, seed=seed)
        obs = SimEnv().reset(task)
        out.append(
            build_messages(
                instruction="Click the blue square.", history=[], screenshots=[obs.screenshot_png]
            )
        )
    return out


def greedy(url: str, messages: list[dict], *, max_tokens: int = 24) -> Completion:
    with PolicyClient(url, timeout=120) as client:
        return client.complete(messages, max_tokens=max_tokens, temperature=0.0)


def gaps(a: Completion, b: Completion) -> list[float]:
    """|log p| differences over the tokens both produced alike (up to the first difference)."""
    out = []
    pairs = zip(a.token_ids, b.token_ids, a.token_logprobs, b.token_logprobs, strict=False)
    for ta, tb, la, lb in pairs:
        if ta != tb:
            break
        out.append(abs(la - lb))
    return out


def reload(stack: VllmStack, checkpoint: Path, version: int) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/reload",
        json={"checkpoint": str(checkpoint), "version": version},
        headers=bearer(stack.tokens.admin),
        timeout=300,
    )


class Load:
    """8 clients, each asking for completions in a loop until the block ends."""

    def __init__(self, url: str, messages: list[dict], n: int = 8) -> None:
        self.versions: list[int | None] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(url, messages)) for _ in range(n)
        ]

    def _loop(self, url: str, messages: list[dict]) -> None:
        with PolicyClient(url, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    self.versions.append(client.complete(messages, max_tokens=6).policy_version)
                except Exception as exc:  # every failure is the test's finding
                    self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        wait_until(lambda: len(self.versions) >= 8, timeout=120, what="answers under load")
        return self

    def __exit__(self, *exc: object) -> None:
        wait_until(lambda: len(self.versions) >= 16, timeout=120, what="answers after")
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=130)


def test_completions_with_a_screenshot_and_logprobs_through_the_openai_client(vllm_stack):
    import openai

    client = openai.OpenAI(base_url=f"{vllm_stack.url}/v1", api_key=vllm_stack.tokens.inference)
    assert [m.id for m in client.models.list().data][:1] == ["policy"]
    reply = client.chat.completions.create(
        model="policy",
        messages=screens(1)[0],
        max_tokens=16,
        temperature=1.0,
        logprobs=True,
        top_logprobs=3,
        seed=7,
    )
    content = reply.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 and len(t.top_logprobs) >= 3 for t in content)
    assert reply.model_extra["policy_version"] == 0
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{vllm_stack.url}/v1", api_key="wrong" * 8).models.list()


def trainer_logprobs(
    messages: list[dict], token_ids: list[int], *, prompt_ids: list[int] | None = None
) -> list[float]:
    """What the trainer computes for these response tokens (teacher-forced, fp32): the
    log-probs truncated importance sampling compares the rollout's with. `prompt_ids`: the
    prompt as the server tokenized it, which a step stores and the trainer trains on."""
    policy = _shipped()
    prompt = prompt_parts(policy, messages, ids=prompt_ids)
    batch = batch_from_parts(policy, [prompt], responses=[token_ids])
    with torch.no_grad():
        values, _, mask = sequence_logprobs(policy.model, batch)
    return values[mask.bool()].tolist()


@functools.cache
def _shipped() -> Policy:
    return load_policy(SHIPPED)


def test_vllm_serves_the_trainers_log_probs_and_the_text_it_wrote(vllm_stack):
    """Greedy on 6 screens through vLLM: its text is its token ids decoded with special
    tokens kept (the history the policy sees next turn is what it wrote), and the trainer,
    scoring the same token ids on the same weights, gets its log-probs within 0.01 nats per
    token on average and 0.05 at most (fp32 both: vLLM's --dtype auto would serve the fp32
    policy in bf16, `rollout.vllm_command.checkpoint_dtype`); the transformers server, greedy
    on the same prompts, writes the same replies."""
    prompts = screens(6)
    served = [greedy(vllm_stack.url, m) for m in prompts]
    tokenizer = _shipped().tokenizer
    for s in served:
        text_ids = s.token_ids[:-1] if s.finish_reason == "stop" else s.token_ids
        assert s.text == tokenizer.decode(text_ids, skip_special_tokens=False)
    assert any("<|box_end|>" in s.text for s in served)  # special tokens are in the text
    # vLLM reports the prompt it tokenized (image pads expanded): the ids a step stores and
    # the trainer trains on, scored here as the trainer scores them.
    assert all(s.prompt_token_ids for s in served)
    diffs = [
        abs(a - b)
        for m, s in zip(prompts, served, strict=True)
        for a, b in zip(
            trainer_logprobs(m, s.token_ids, prompt_ids=list(s.prompt_token_ids)),
            s.token_logprobs,
            strict=True,
        )
    ]
    with LocalPolicyServer(SHIPPED) as transformers_url:
        expected = [greedy(transformers_url, m) for m in prompts]
    same = sum(e.text == s.text for e, s in zip(expected, served, strict=True))
    same_ids = sum(
        e.prompt_token_ids == s.prompt_token_ids for e, s in zip(expected, served, strict=True)
    )
    # The rollout's count of each prompt (`core.prompt_counter`) is both servers' own.
    counter = PromptCounter.from_policy_dir(SHIPPED)
    counted = [
        counter.reply
        + sum(
            counter.text(role=m["role"], text=m["content"])
            if isinstance(m["content"], str)
            else counter.image(decode_image_parts([m])[0])
            for m in messages
        )
        for messages in prompts
    ]
    assert [len(s.prompt_token_ids) for s in served] == counted
    assert [len(e.prompt_token_ids) for e in expected] == counted
    print(f"\nvLLM vs the trainer on vLLM's greedy tokens, 6 screens: {len(diffs)} tokens, "
          f"mean |dlogp| {statistics.mean(diffs):.5f}, max {max(diffs):.5f} nats; "
          f"greedy replies equal to the transformers server's: {same} of 6, prompt ids "
          f"equal: {same_ids} of 6")  # fmt: skip
    assert statistics.mean(diffs) < 0.01 and max(diffs) < 0.05
    assert [s.text for s in served] == [e.text for e in expected]


def _changed(base: Path, out: Path, *, lora: bool) -> Path:
    """A version of `base` whose outputs differ: LoRA B matrices drawn at random (an adapter
    directory), or the language model's MLP outputs and norms scaled (full weights)."""
    run_dir = out / ("lora" if lora else "full")
    shutil.rmtree(run_dir, ignore_errors=True)
    adapters = {"lora_rank": 8, "lora_alpha": 16} if lora else {}
    trainer = PolicyTrainer(
        config=TrainerConfig(lr=1e-3, kl_coef=0.0, **adapters),
        start_checkpoint=base,
        run_dir=run_dir,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.policy.model.named_parameters():
            if lora and "lora_B" in name:
                p.normal_(std=0.3)
            elif not lora and "visual" not in name and ("mlp.down_proj" in name or "norm" in name):
                p.mul_(1.5)  # norms too: a layer vLLM's reload skipped would show
    return trainer.save_version(1)


def _served_as(stack: VllmStack, checkpoint: Path, prompt: list[dict], before: Completion):
    """The adapter now answers with `checkpoint`'s log-probs, which are not `before`'s."""
    now = greedy(stack.url, prompt)
    with LocalPolicyServer(checkpoint) as url:
        expected = greedy(url, prompt)
    assert now.token_ids == expected.token_ids
    assert max(gaps(expected, now)) < 0.05
    assert now.token_ids != before.token_ids or max(gaps(before, now)) > 0.1


def test_a_lora_switch_and_a_full_reload_under_load_fail_no_request(vllm_stack):
    checkpoints = Path(settings.DARTBOARD_HOME) / "policies" / "vllm-test"  # a reload root
    adapter = _changed(SHIPPED, checkpoints, lora=True)
    full = _changed(SHIPPED, checkpoints, lora=False)
    prompt = screens(1)[0]
    before = greedy(vllm_stack.url, prompt)
    with Load(vllm_stack.url, prompt) as load:
        r = reload(vllm_stack, adapter, 1)
        assert r.status_code == 200, r.text
    assert load.errors == [] and {0, 1} <= set(load.versions)
    _served_as(vllm_stack, adapter, prompt, before)

    with Load(vllm_stack.url, prompt) as load:
        r = reload(vllm_stack, full, 2)
        assert r.status_code == 200, r.text
    assert load.errors == [] and {1, 2} <= set(load.versions)
    _served_as(vllm_stack, full, prompt, before)
    health = httpx.get(f"{vllm_stack.url}/health").json()
    assert health["policy_version"] == 2 and health["serving"] == "policy"  # base, no adapter

    r = reload(vllm_stack, SHIPPED, 3)  # back to the shipped weights for the other tests
    assert r.status_code == 200, r.text


def test_a_restarted_adapter_finds_its_version_loaded_in_vllm_and_serves(vllm_stack):
    checkpoints = Path(settings.DARTBOARD_HOME) / "policies" / "vllm-test-restart"
    adapter = _changed(SHIPPED, checkpoints, lora=True)
    assert reload(vllm_stack, adapter, 7).status_code == 200
    child = vllm_stack.supervisor.children["inference-0"]
    child.proc.terminate()
    child.proc.wait(30)
    vllm_stack.supervisor.watch_once()  # the launcher's watch: the adapter comes back (v0)
    wait_until(lambda: _models_listed(vllm_stack.url, vllm_stack.tokens), timeout=60,
               what="the adapter back")  # fmt: skip
    r = reload(vllm_stack, adapter, 7)  # the router's sync: vLLM holds policy-v7 already
    assert r.status_code == 200, r.text
    served = greedy(vllm_stack.url, screens(1)[0])
    assert served.policy_version == 7 and served.token_ids
    assert reload(vllm_stack, SHIPPED, 8).status_code == 200


def _router_over(stack: VllmStack):
    """A router process over the stack's one vLLM worker, as the launcher starts it."""
    port = free_port()
    args = ["rollout.router", "--port", str(port), "--probe-interval", "0.5"]
    proc = start_process(
        [*args, "--worker", stack.url], health_url=f"http://127.0.0.1:{port}/health"
    )
    return proc, f"http://127.0.0.1:{port}"


def test_versions_pulled_from_the_weight_server_into_vllm_under_8_clients_fail_no_request(
    vllm_stack,
):
    """Full weights, then LoRA adapters, pulled over torch.distributed from a weight server
    into vLLM's engine through the router's sync, while 8 clients ask the router."""
    checkpoints = Path(settings.DARTBOARD_HOME) / "policies" / "vllm-test-pull"
    full = _changed(SHIPPED, checkpoints, lora=False)
    lora_run = checkpoints / "lora-pulled"
    shutil.rmtree(lora_run, ignore_errors=True)
    trainer = PolicyTrainer(
        config=TrainerConfig(lr=1e-3, kl_coef=0.0, lora_rank=8, lora_alpha=16),
        start_checkpoint=SHIPPED,
        run_dir=lora_run,
    )
    prompt = screens(1)[0]
    before = greedy(vllm_stack.url, prompt)
    start = httpx.get(f"{vllm_stack.url}/health").json()["policy_version"]
    assert httpx.get(f"{vllm_stack.url}/health").json()["pulls_weights"] is True
    server = WeightServer(host="127.0.0.1", timeout_s=60, window_bytes=1 << 20)
    proc, router = _router_over(vllm_stack)
    admin = RouterAdmin(router)
    try:
        # Full weights: pulled into vLLM, not read from `full`'s files.
        tensors = dict(load_policy(full).model.named_parameters())
        source = server.publish(version=start + 1, kind="full", tensors=tensors)
        with ClientLoops(router, n=8, max_tokens=6) as loops:
            wait_until(lambda: loops.each_has(1), timeout=120, what="first answers")
            admin.sync(str(SHIPPED), start + 1, weights=source)  # a checkpoint of other weights
            admin.wait_for_version(start + 1, timeout=240)
            t_done = time.monotonic()
            wait_until(lambda: loops.each_has(1, after=t_done), timeout=120, what="answers after")
        assert loops.errors == []
        assert {c.completion.policy_version for c in loops.all()} == {start, start + 1}
        assert [r.outcome for r in server.pulls] == ["verified"]
        _served_as(vllm_stack, full, prompt, before)

        # LoRA, on the shipped base again: the first adapter comes by checkpoint (nothing on
        # the wire fits the base), the next ones over the wire, switched to while serving.
        admin.sync(str(SHIPPED), start + 2)
        admin.wait_for_version(start + 2, timeout=240)
        with torch.no_grad():
            for name, p in trainer.policy.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.3)
        first = trainer.save_version(1)
        kind, tensors = trainer.served_weights()
        source = server.publish(version=start + 3, kind=kind, tensors=tensors)
        admin.sync(str(first), start + 3, weights=source)
        admin.wait_for_version(start + 3, timeout=240)
        for step in (4, 5):
            with torch.no_grad():  # every tensor of the adapter moves: all must travel
                for name, p in trainer.policy.model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(std=0.3)
                    elif "lora_A" in name:
                        p.add_(torch.randn_like(p) * 0.05)
            saved = trainer.save_version(step)  # what the pulled adapter must equal
            kind, tensors = trainer.served_weights()
            source = server.publish(version=start + step, kind=kind, tensors=tensors)
            with ClientLoops(router, n=8, max_tokens=6) as loops:
                wait_until(lambda: loops.each_has(1), timeout=120, what="first answers")
                admin.sync(str(first), start + step, weights=source)  # the files: v1's adapter
                admin.wait_for_version(start + step, timeout=240)
                t_done = time.monotonic()
                wait_until(lambda t=t_done: loops.each_has(1, after=t), timeout=120, what="after")
            assert loops.errors == []
            _served_as(vllm_stack, saved, prompt, before)
        assert [r.outcome for r in server.pulls] == [
            "verified",  # full weights
            "refused: this worker serves the base model: an adapter comes by checkpoint",
            "verified",
            "verified",
        ]
        events = httpx.get(f"{router}/admin/events", headers=ADMIN).json()
        failed = [e for e in events if e["status"] == "pull failed"]
        assert len(failed) == 1 and "an adapter comes by checkpoint" in failed[0]["detail"]
        health = httpx.get(f"{vllm_stack.url}/health").json()
        assert health["policy_version"] == start + 5 and health["serving"].endswith(
            f"-v{start + 5}"
        )
    finally:
        admin.close()
        stop_process(proc)
        server.close()
    r = reload(vllm_stack, SHIPPED, start + 6)  # back to the shipped weights
    assert r.status_code == 200, r.text
