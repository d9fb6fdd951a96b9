"""The whole loop on one GPU at Qwen2.5-VL-7B's shape with random weights, in about 8 minutes:
the transformers inference server on CUDA serving a group of episodes (UI-TARS-1.5's prompt,
1920x1080 screenshots from a stand-in environment), one LoRA update with gradient
checkpointing on their steps, the adapter synced into the server and served, and a trainer
resumed from the saved version giving the same log-probs. Prints one table.

    .venv/bin/python bench/gpu_loop.py              # a GPU host: 7B shape, CUDA
    .venv/bin/python bench/gpu_loop.py --cpu        # this CPU: the tiny policy (the suite runs it)

The stand-in environment answers every action with the next of five screens and scores
every other episode a success, so the group has an advantage to train on; a random model's
replies are mostly unparsable, which the runner records as no-op steps, as it would a real
model's. Everything runs under a temporary DARTBOARD_HOME; the server starts as the launcher
starts an inference worker, with `--device cuda` on a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_smoke import SCREEN, SCREENS, _reload, _screens, _setup  # noqa: E402

EPISODES = 4  # one group
QWEN25_7B = {"hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4, "intermediate": 18944,
             "vision_hidden": 1280, "vision_depth": 32, "vision_heads": 16,
             "fullatt_blocks": (7, 15, 23, 31), "model_vocab": 152064}  # fmt: skip


class ScreensEnv:
    """A stand-in desktop: five 1920x1080 screens in turn; every other episode succeeds."""

    kind = "sim"

    def __init__(self, screens: list[bytes], *, succeeds: bool) -> None:
        self.screens = screens
        self.succeeds = succeeds
        self.shown = 0

    def _observe(self):
        from core.protocol import Observation

        png = self.screens[self.shown % len(self.screens)]
        return Observation(screenshot_png=png, width=SCREEN[0], height=SCREEN[1],
                           instruction="Open the Settings window and turn on dark mode.")  # fmt: skip

    def reset(self, task):
        self.shown = 0
        return self._observe()

    def step(self, action):
        self.shown += 1
        return self._observe()

    def evaluate(self, *, ended_by=None):
        from core.protocol import Evaluation

        return Evaluation(reward=float(self.succeeds), success=self.succeeds)

    def close(self) -> None:
        pass


class RecordingClient:
    """The policy client, keeping each call's episode and messages beside its completion:
    the exact prompt a step's policy saw, which the update trains on. An episode's thread
    names its episode in `current.episode`."""

    def __init__(self, client) -> None:
        self.client = client
        self.calls: list[tuple[int, list[dict], object]] = []
        self.current = threading.local()
        self._lock = threading.Lock()

    def complete(self, messages, **kwargs):
        completion = self.client.complete(messages, **kwargs)
        with self._lock:
            self.calls.append((self.current.episode, messages, completion))
        return completion


def build_model(workdir: Path, *, cpu: bool) -> Path:
    """The tiny policy on the CPU; on a GPU, Qwen2.5-VL-7B's shape drawn there in bf16 with
    the released processor bounds (bench/update_cost.py's narrow model, at full width)."""
    if cpu:
        return ROOT / "policies" / "tiny-grounded"
    import torch

    from bench.update_cost import released_processor
    from training.tiny_policy import build_tiny_policy

    out = build_tiny_policy(workdir / "qwen2.5-vl-7b-shape", arch="qwen2_5_vl", **QWEN25_7B,
                            init_device="cuda", dtype=torch.bfloat16)  # type: ignore[arg-type]  # fmt: skip
    released_processor(out)
    torch.cuda.empty_cache()
    return out


def run_group(url: str, screens: list[bytes], counter, *, max_new_tokens: int,
              steps: int) -> tuple[RecordingClient, list]:  # fmt: skip
    """EPISODES episodes at once through the episode runner, UI-TARS-1.5's prompt."""
    from core.protocol import TaskSpec
    from rollout.client import PolicyClient
    from rollout.episode import EpisodeConfig, ListRecorder, play_episode

    client = RecordingClient(PolicyClient(url, timeout=900))
    config = EpisodeConfig(step_cap=steps, max_images=SCREENS, max_prompt_tokens=32768,
                           max_new_tokens=max_new_tokens, max_parse_errors=steps,
                           prompt="ui-tars-1.5", prompt_counter=counter, seed=0)  # fmt: skip
    results: list = [None] * EPISODES

    def one(i: int) -> None:
        client.current.episode = i
        results[i] = play_episode(env=ScreensEnv(screens, succeeds=i % 2 == 0), policy=client,
                                 recorder=ListRecorder(), task=TaskSpec("stand-in", "sim"),
                                 config=config)  # fmt: skip

    threads = [threading.Thread(target=one, args=(i,)) for i in range(EPISODES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return client, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the tiny policy on this CPU")
    ap.add_argument("--steps", type=int, default=3, help="steps per episode")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    rows, _ = run(cpu=args.cpu, steps=args.steps, max_new_tokens=args.max_new_tokens)
    print("\n| check | result |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def run(
    *, cpu: bool, steps: int, max_new_tokens: int
) -> tuple[list[tuple[str, str]], dict[str, float]]:
    """The loop's steps in order; returns the table's rows and its figures by name. Raises
    SystemExit on a failure a user must see (the server not answering, a sync refused)."""
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        _setup(home)
        return _loop(home, cpu=cpu, steps=steps, max_new_tokens=max_new_tokens)


def _loop(
    home: Path, *, cpu: bool, steps: int, max_new_tokens: int
) -> tuple[list[tuple[str, str]], dict[str, float]]:
    """Long because it is the loop's checks in order, sharing one server and one home."""
    import torch
    from django.conf import settings

    from core.prompt_counter import PromptCounter
    from hostagent.launcher import ProcSpec, Supervisor, inference_env, python_argv, wait_http
    from rollout.auth import ServiceTokens
    from rollout.client import PolicyClient
    from training.config import CurationConfig, TrainerConfig
    from training.memory_plan import Sample, checkpoint_shape, trainer_memory
    from training.trainer import PolicyTrainer

    device = "cpu" if cpu else "cuda"
    rows: list[tuple[str, str]] = [("device", torch.cuda.get_device_name(0) if not cpu else "CPU")]
    figures: dict[str, float] = {}
    started_all = time.monotonic()
    started = time.monotonic()
    model = build_model(home, cpu=cpu)
    rows.append(("model", f"{model.name} ({'built here, ' if not cpu else ''}"
                          f"{time.monotonic() - started:.0f} s)"))  # fmt: skip
    counter = PromptCounter.from_policy_dir(model)
    screens = _screens(SCREENS, SCREEN)

    tokens = ServiceTokens(settings.DARTBOARD_INFERENCE_TOKEN, settings.DARTBOARD_ADMIN_TOKEN)
    port = 18701
    argv = python_argv("-m", "rollout.server", "--policy", str(model), "--host", "127.0.0.1",
                       "--port", str(port), "--device", device, "--max-batch", str(EPISODES),
                       "--checkpoint-root", str(home), "--checkpoint-root", str(model.parent))  # fmt: skip
    if cpu:
        argv += ["--threads", "1"]
    supervisor = Supervisor(home=home, specs=[ProcSpec("inference-0", argv,
                                                       env=inference_env(tokens), inherit=False)])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    supervisor.start()
    try:
        if not wait_http(f"{url}/health", timeout=900):
            raise SystemExit(f"the inference server did not answer in 900 s: {home}/logs")
        rows.append(("server start to healthy", f"{time.monotonic() - started:.0f} s"))

        # 1. A group of episodes, served.
        started = time.monotonic()
        client, results = run_group(url, screens, counter, max_new_tokens=max_new_tokens,
                                    steps=steps)  # fmt: skip
        seconds = time.monotonic() - started
        longest = max(c.prompt_tokens for _, _, c in client.calls)
        rows.append(("episodes (UI-TARS-1.5 prompt, 1920x1080)",
                     f"{EPISODES} episodes, {len(client.calls)} steps in {seconds:.0f} s; "
                     f"longest prompt {longest:,} tokens"))  # fmt: skip
        batch = _samples(client, results)

        # 2. One LoRA update with gradient checkpointing; the version saved.
        settings = TrainerConfig(lr=1e-4, kl_coef=0.1, micro_batch=1, lora_rank=16, lora_alpha=32,
                                 gradient_checkpointing="on")  # fmt: skip
        trainer = PolicyTrainer(config=settings, start_checkpoint=model,
                                run_dir=home / "checkpoints" / "run-1", device=device)  # fmt: skip
        if not cpu:
            torch.cuda.reset_peak_memory_stats()
        metrics = trainer.update(batch, CurationConfig(high_entropy=False))
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if not cpu else ""
        rows.append(("LoRA r16 update, gradient checkpointing",
                     f"{metrics.duration_s:.1f} s for {len(batch)} steps ({metrics.passes}; "
                     f"encode {metrics.encode_s:.1f} s){peak}"))  # fmt: skip
        # The memory plan of the same update (its longest step, micro-batch 1), beside it.
        shown = min(steps, 5) * counter.geometry.tokens(width=SCREEN[0], height=SCREEN[1])
        shape = checkpoint_shape(model)
        assert shape is not None
        step = Sample(
            tokens=longest + max_new_tokens, reply=max_new_tokens, patches=shown * shape.merge
        )
        plan = trainer_memory(shape, lora_rank=16, kl=True, checkpointing=True,
                              micro_batch_tokens=step.tokens, sample=step, cuda=not cpu)  # fmt: skip
        measured = torch.cuda.max_memory_allocated() / plan.total if not cpu else None
        rows.append(("the memory plan of that update (training.memory_plan)",
                     plan.describe() + (f"; measured / plan {measured:.2f}" if measured else "")))  # fmt: skip
        if measured:
            figures["peak_over_plan"] = measured
        if metrics.optimizer_steps != 1:
            raise SystemExit(f"the update took {metrics.optimizer_steps} optimizer steps, not 1")
        saved = trainer.save_version(1)
        probe = batch[:2]
        with torch.no_grad():
            trained, _, mask = trainer.logprob_fn(trainer.policy.model, probe)
        trained = trained[mask.bool()].float().cpu()

        # 3. The adapter synced into the server and served.
        seconds, status = _reload(url, tokens.admin, saved, 1)
        if status != 200:
            raise SystemExit(f"the server refused version 1 (HTTP {status}): {home}/logs")
        gaps = []
        with PolicyClient(url, timeout=900) as live:
            for sample in probe:
                served = live.complete(sample.messages, max_tokens=16, temperature=0.0)
                if served.policy_version != 1:
                    raise SystemExit(f"the server answered as version {served.policy_version}")
                values = _score(trainer, sample.messages, served.token_ids)
                gaps += [abs(a - b) for a, b in zip(values, served.token_logprobs, strict=True)]
        rows.append(("adapter synced into the server", f"{seconds:.1f} s, HTTP {status}; "
                     "replies as version 1"))  # fmt: skip
        figures["gap_max"] = max(gaps)
        figures["steps"] = len(batch)
        rows.append(("log-prob gap after the sync, trainer vs server",
                     f"mean {statistics.mean(gaps):.4f}, max {max(gaps):.4f} nats/token "
                     f"({len(gaps)} tokens)"))  # fmt: skip
        del trainer
        if not cpu:
            torch.cuda.empty_cache()

        # 4. A trainer resumed from the saved version scores the same.
        resumed = PolicyTrainer(config=settings, start_checkpoint=model,
                                run_dir=home / "checkpoints" / "run-1", device=device,
                                published_versions=[1])  # fmt: skip
        with torch.no_grad():
            again, _, mask = resumed.logprob_fn(resumed.policy.model, probe)
        again = again[mask.bool()].float().cpu()
        figures["resume_max_diff"] = float((again - trained).abs().max())
        figures["resumed_version"] = resumed.state.version
        rows.append(("resumed from version 1",
                     f"updates {resumed.state.updates}, version {resumed.state.version}; "
                     f"max abs log-prob difference {float((again - trained).abs().max()):.2e} "
                     f"over {again.numel()} tokens"))  # fmt: skip
    finally:
        supervisor.stop()
    rows.append(("the whole loop", f"{time.monotonic() - started_all:.0f} s"))
    return rows, figures


def _samples(client: RecordingClient, results: list) -> list:
    """One TrainSample per policy call, with its episode's reward; the group is the task's."""
    from core.samples import TrainSample

    return [
        TrainSample(step_id=n + 1, trajectory_id=episode + 1, group_id=0, messages=messages,
                    response_text=completion.text, reward=float(results[episode].reward),
                    rollout_logprobs=list(completion.token_logprobs), mean_entropy=1.0,
                    policy_version=0, response_token_ids=list(completion.token_ids))
        for n, (episode, messages, completion) in enumerate(client.calls)
    ]  # fmt: skip


def _score(trainer, messages, token_ids) -> list[float]:
    import torch

    from core.encoding import encode_batch
    from core.generation import sequence_logprobs

    batch = encode_batch(trainer.policy, [messages], responses=[list(token_ids)])
    with torch.no_grad(), trainer.autocast():
        values, _, mask = sequence_logprobs(trainer.policy.model, batch)
    return values[mask.bool()].tolist()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
