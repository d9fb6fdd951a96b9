"""Settings the inference workers accept: a run's own workers start at its budgets (reply
tokens, prompt tokens, images, LoRA rank), and a run the shared workers would refuse request
by request is refused when it is created, with the limit and the way out."""

from __future__ import annotations

import pytest

from core.prompts import image_part
from datamanager.config import ConfigInvalid, RunConfig
from datamanager.services.runs import run_config_validate
from hostagent.agent import run_specs
from hostagent.placement import Placement
from rollout.limits import SHARED, ServingLimits, vllm_lora_rank
from rollout.server import RequestError, parse_chat_request
from rollout.vllm_command import vllm_serve_args
from tests.conftest import png_bytes

pytestmark = pytest.mark.django_db


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_runs_workers_start_at_its_own_budgets() -> None:
    cfg = RunConfig.from_dict(
        {
            "policy": "untrained",
            "rollout": {"max_new_tokens": 2048, "max_images": 20, "max_prompt_tokens": 40000},
            "trainer": {"lora_rank": 96},
        }
    )
    placement = Placement(host="h", device="cpu", inference_gpus=[None], router_port=9000,
                          worker_ports=[9001])  # fmt: skip
    specs = run_specs(run_id=7, cfg=cfg, placement=placement, checkpoint="/ckpt", version=3)
    [server] = [s for s in specs if s.name == "run-7-inference-0"]
    assert _flag(server.argv, "--max-tokens-limit") == "2048"
    assert _flag(server.argv, "--max-images") == "20"
    assert int(_flag(server.argv, "--max-prompt-tokens")) == 40000

    limits = ServingLimits.for_run(max_new_tokens=2048, max_prompt_tokens=40000, max_images=20,
                                   lora_rank=96)  # fmt: skip
    vllm = vllm_serve_args(model_dir="/ckpt", uds="/tmp/v.sock", limits=limits)
    assert _flag(vllm, "--max-lora-rank") == "128"  # the smallest rank vLLM serves above 96
    assert int(_flag(vllm, "--max-model-len")) == 40000 + 2048
    assert _flag(vllm, "--limit-mm-per-prompt") == '{"image": 20}'
    assert "--no-enable-chunked-prefill" not in vllm
    # vLLM's CPU build takes a prompt in one prefill (a seeded one split in chunks kills it).
    cpu = vllm_serve_args(model_dir="/ckpt", uds="/tmp/v.sock", limits=limits, cpu_build=True)
    assert cpu == [*vllm, "--no-enable-chunked-prefill"]


def test_a_server_refuses_more_images_than_it_was_started_with() -> None:
    image = image_part(png_bytes())
    body = {"messages": [{"role": "user", "content": [image, image, image]}], "max_tokens": 8}
    with pytest.raises(RequestError, match="at most 2"):
        parse_chat_request(body, default_model="p", max_tokens_limit=64, max_images=2)


def test_lora_ranks_round_up_to_one_vllm_serves() -> None:
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 65, 300, 512)] == [
        1, 8, 8, 16, 64, 128, 320, 512,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="up to 512"):
        vllm_lora_rank(513)
    with pytest.raises(
        ConfigInvalid, match=r"trainer\.lora_rank: vLLM serves LoRA adapters of rank"
    ):
        RunConfig.from_dict({"rollout": {"backend": "vllm"}, "trainer": {"lora_rank": 600}})


def test_the_shared_workers_limits_are_checked_when_the_run_is_created(settings) -> None:
    settings.DARTBOARD_PROCESSES = "shared"
    data = {
        "policy": "untrained",
        "rollout": {"backend": "vllm", "max_new_tokens": 2048, "max_images": 20},
        "trainer": {"lora_rank": 128},
    }
    with pytest.raises(ConfigInvalid) as refused:
        run_config_validate(data=data, user=None)
    messages = [str(p) for p in refused.value.problems]
    assert any(
        m.startswith(f"rollout.max_new_tokens: at most {SHARED.max_new_tokens} on the shared")
        for m in messages
    ), messages
    assert any(m.startswith(f"rollout.max_images: at most {SHARED.max_images}") for m in messages)
    assert any(m.startswith(f"trainer.lora_rank: at most {SHARED.max_lora_rank}") for m in messages)
    # A run with its own processes starts its workers at its own settings.
    settings.DARTBOARD_PROCESSES = "per-run"
    assert run_config_validate(data=data, user=None).rollout.max_new_tokens == 2048
