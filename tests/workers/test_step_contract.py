"""One step from the policy's server to the trainer and the export: the step stores the prompt
token ids the server reported, the trainer trains on those ids (not on a new tokenization),
and the SFT export writes the chat the policy was given, token for token. Steps stored before
the ids were kept still train. Driven through the real episode runner, a real
`rollout.server` serving the tiny policy over HTTP, and the sim backend."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from core.completion import Completion
from core.encoding import prompt_parts
from core.policy import load_policy
from core.prompts import image_part
from core.steps import pack_token_ids, unpack_token_ids
from datamanager.models import Run, Step, Task, Trajectory
from datamanager.selectors.trajectories import TrajectoryFilter
from datamanager.services import episodes
from datamanager.services.batches import trajectory_samples
from datamanager.services.datasets import dataset_write
from rollout.client import PolicyClient
from rollout.local_server import LocalPolicyServer
from tests.datamanager.factories import make_running_run
from training.prompt_cache import PromptCache
from workers.config_mapping import episode_config
from workers.env_cache import TaskEnv
from workers.episode_runner import DbRecorder, episode_run

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


class Kept:
    """The real client, keeping every request's messages and the server's answer."""

    def __init__(self, client: PolicyClient) -> None:
        self.client = client
        self.messages: list[list[dict[str, Any]]] = []
        self.completions: list[Completion] = []

    def complete(self, messages: list[dict[str, Any]], **kwargs: Any) -> Completion:
        completion = self.client.complete(messages, **kwargs)
        self.messages.append(messages)
        self.completions.append(completion)
        return completion


def _episode(run, tiny_policy_dir: Path) -> tuple[Trajectory, list[Step], Kept]:
    cfg = run.cfg
    claim = episodes.task_claim(run_id=run.pk, slot_id=None, env_kinds=("sim",))
    assert claim is not None
    env = TaskEnv(
        backend="sim", env_config=claim.task.env_config, env=cfg.env, timeout_s=10.0, oracle=None
    )
    with LocalPolicyServer(tiny_policy_dir) as url:
        kept = Kept(PolicyClient(url))
        outcome = episode_run(
            trajectory_id=claim.trajectory_id,
            task=claim.task,
            env=env,
            policy=kept,
            recorder=DbRecorder(claim.trajectory_id),
            config=episode_config(cfg, step_cap=3, seed=claim.decode_seed),
        )
    assert outcome.end.name == "RAN", outcome
    traj = Trajectory.objects.get(pk=claim.trajectory_id)
    return traj, list(Step.objects.filter(trajectory=traj).order_by("index")), kept


def _openai_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """An SFT row's prompt (all but the reply) as OpenAI messages, its images put back."""
    images = iter(image["bytes"] for image in row["images"])
    return [
        {
            "role": m["role"],
            "content": [
                {"type": "text", "text": p["text"]}
                if p["type"] == "text"
                else image_part(next(images))
                for p in m["content"]
            ],
        }
        for m in row["messages"][:-1]
    ]


def _as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with string contents as one text part (the chat-template layout's form)."""
    return [
        {
            "role": m["role"],
            "content": [{"type": "text", "text": m["content"]}]
            if isinstance(m["content"], str)
            else m["content"],
        }
        for m in messages
    ]


def test_the_trainer_and_the_export_read_the_ids_and_chat_the_policy_was_given(
    tiny_policy_dir, tmp_path, settings
):
    settings.DARTBOARD_ENV_LATENCY_SCALE = 0.0
    Task.objects.create(
        name="sim/three",
        env_kind="sim",
        env_config={"targets": 3},
        instruction="Click the three targets",
    )
    run = make_running_run(
        {
            "policy": str(tiny_policy_dir),
            "tasks": {"env_kinds": ["sim"], "instances": 1},
            "env": {"miniwob_slots": 0, "sim_slots": 1},
            "rollout": {"max_images": 2, "max_new_tokens": 8, "max_parse_errors": 5},
        }
    )
    traj, steps, kept = _episode(run, tiny_policy_dir)
    reported = [list(c.prompt_token_ids) for c in kept.completions]
    assert len(steps) == len(reported) == 3 and all(reported)
    # The step stores what the server reported.
    assert [unpack_token_ids(s.prompt_token_ids) for s in steps] == reported

    # The run's prompt setting changes after the episode (one screenshot, not two): what
    # was given is read back, not rebuilt with today's settings.
    Run.objects.filter(pk=run.pk).update(
        config={**run.config, "rollout": {**run.config["rollout"], "max_images": 1}}
    )
    run.refresh_from_db()

    # The trainer trains on those ids: the samples carry them and the update's encoding
    # gives them back, whatever this process's tokenizer would make of the messages.
    policy = load_policy(tiny_policy_dir)
    samples = trajectory_samples(traj, steps, group_id=0, cfg=run.cfg, is_demo=False)
    assert [s.prompt_token_ids for s in samples] == reported
    assert [s.messages for s in samples] == kept.messages
    cache = PromptCache(max_bytes=0)
    assert [cache.get(policy, s).ids for s in samples] == reported
    # Proof that the ids are read, not rebuilt: a stored id changed shows up in training.
    tampered = list(reported[0])
    tampered[1] = (tampered[1] + 1) % policy.tokenizer.vocab_size
    Step.objects.filter(pk=steps[0].pk).update(prompt_token_ids=pack_token_ids(tampered))
    again = trajectory_samples(
        traj, [Step.objects.get(pk=steps[0].pk)], group_id=0, cfg=run.cfg, is_demo=False
    )
    assert PromptCache(max_bytes=0).get(policy, again[0]).ids == tampered

    # A step stored before the ids were kept trains on its stored messages, encoded here.
    Step.objects.filter(pk=steps[0].pk).update(prompt_token_ids=b"")
    legacy = trajectory_samples(
        traj, [Step.objects.get(pk=steps[0].pk)], group_id=0, cfg=run.cfg, is_demo=False
    )
    assert legacy[0].prompt_token_ids is None
    assert PromptCache(max_bytes=0).get(policy, legacy[0]).ids == reported[0]

    # The SFT export is the chat the policy was given, token for token, and the reply it wrote.
    out = tmp_path / "export"
    dataset_write(flt=TrajectoryFilter(run_id=run.pk), formats=["sft"], out=out)
    table = pq.read_table(sorted((out / "sft").rglob("*.parquet"))[0])
    rows = sorted(table.to_pylist(), key=lambda r: r["step_index"])
    assert [r["step_index"] for r in rows] == [0, 1, 2]
    for row, step, ids, messages in zip(rows, steps, reported, kept.messages, strict=True):
        assert _openai_messages(row) == _as_parts(messages)
        assert prompt_parts(policy, _openai_messages(row)).ids == ids
        assert row["messages"][-1]["content"][0]["text"] == step.raw_output
    assert io.BytesIO(rows[0]["images"][0]["bytes"]).read(8) == b"\x89PNG\r\n\x1a\n"
