"""The warm start's behaviour-cloning loss on desktop oracle demos, written in two image
geometries: Qwen2.5-VL's released bounds (what demos were written in before the geometry
came from the policy's processor) and the shipped policy's own processor.

    .venv/bin/python bench/demo_geometry.py

Prints, per desktop task, the shipped policy's mean negative log-likelihood per response
token of the demo's steps (prompts built exactly as rollout builds them), for each geometry.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from core.encoding import encode_batch, response_token_ids  # noqa: E402
from core.generation import sequence_logprobs  # noqa: E402
from core.imaging import QWEN25_VL, ImageGeometry  # noqa: E402
from core.losses import bc_loss  # noqa: E402
from core.policy import load_policy  # noqa: E402
from core.prompt_counter import PromptCounter  # noqa: E402
from core.prompts import HistoryTurn, build_messages  # noqa: E402
from core.protocol import TaskSpec  # noqa: E402
from envmanager.demo_collection import collect_demo  # noqa: E402
from envmanager.desktop_env import DesktopEnv  # noqa: E402
from envmanager.desktop_tasks import DESKTOP_TASKS  # noqa: E402
from envmanager.miniwob_env import MiniWoBEnv  # noqa: E402

SHIPPED = ROOT / "policies" / "tiny-grounded"


def demo_nll(policy, outcome) -> float:
    """Mean NLL per response token over the demo's steps (max_images 3, as make run)."""
    counter = PromptCounter.from_policy_dir(policy.path)
    history: list[HistoryTurn] = []
    shots: list[bytes] = []
    losses = []
    for step in outcome.steps:
        png, raw = step.screenshot_png, step.raw_output
        shots.append(png)
        messages = build_messages(
            instruction=outcome.instruction,
            history=history,
            screenshots=shots[-3:],
            max_images=3,
            max_prompt_tokens=4096,
            counter=counter,
        )
        batch = encode_batch(policy, [messages], responses=[response_token_ids(policy, raw)])
        with torch.no_grad():
            logprobs, _, mask = sequence_logprobs(policy, batch)
        losses.append(float(bc_loss(logprobs, mask)))
        history.append(HistoryTurn.from_output(raw))
    return statistics.fmean(losses)


def main() -> None:
    torch.set_num_threads(2)
    policy = load_policy(SHIPPED)
    shipped = ImageGeometry.from_policy_dir(SHIPPED)
    env = DesktopEnv(evaluate_wait_s=0.5)
    rows = []
    try:
        for name in sorted(DESKTOP_TASKS):
            spec = TaskSpec(name=name, env_kind="desktop", env_config={"task": name}, seed=10_000)
            old = collect_demo(env=env, task=spec, geometry=QWEN25_VL)
            new = collect_demo(env=env, task=spec, geometry=shipped)
            rows.append((name, demo_nll(policy, old), demo_nll(policy, new)))
    finally:
        env.close()
    # Control: a MiniWoB++ click demo (160x210 is the same model image in both geometries),
    # on the screens the shipped policy was pretrained on.
    miniwob = MiniWoBEnv()
    try:
        spec = TaskSpec(
            name="miniwob/click-button",
            env_kind="miniwob",
            env_config={"task": "click-button"},
            seed=10_000,
        )
        demo = collect_demo(env=miniwob, task=spec, geometry=shipped)
        control = demo_nll(policy, demo)
    finally:
        miniwob.close()
    print(f"shipped policy {SHIPPED.name}: processor {shipped}")
    print(
        "| desktop task | NLL/token, Qwen2.5-VL bounds (before) | NLL/token, policy's processor |"
    )
    print("|---|---:|---:|")
    for name, old, new in rows:
        print(f"| {name} | {old:.2f} | {new:.2f} |")
    print(
        f"| mean | {statistics.fmean(r[1] for r in rows):.2f} | "
        f"{statistics.fmean(r[2] for r in rows):.2f} |"
    )
    print(f"| control: miniwob/click-button | {control:.2f} | {control:.2f} |")


if __name__ == "__main__":
    main()
