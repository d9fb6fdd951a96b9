"""What an inference worker accepts, in one place: the reply tokens, prompt tokens and images
of a request, and the LoRA rank of an adapter. `rollout.server`, the vLLM adapter and vLLM
itself are started with a run's own limits (`ServingLimits.for_run`) when the run has its own
processes; the shared stack's workers run at `SHARED`, and a run whose settings pass them is
refused when it is created (`datamanager.services.runs.run_config_validate`), not by a 400
in the middle of its first episode.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BATCH = 8  # requests rollout.server generates together (--max-batch's default)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM serves (`--max-lora-rank` takes one of these)."""


@dataclass(frozen=True)
class ServingLimits:
    """The largest request an inference worker takes: `max_new_tokens` reply tokens, a
    prompt of `max_prompt_tokens` tokens (images included) with at most `max_images`
    images, and LoRA adapters of rank up to `max_lora_rank` (vLLM's cache is sized by it)."""

    max_new_tokens: int = 1024
    max_prompt_tokens: int = 32768
    max_images: int = 16
    max_lora_rank: int = 64

    @classmethod
    def for_run(
        cls, *, max_new_tokens: int, max_prompt_tokens: int, max_images: int, lora_rank: int
    ) -> ServingLimits:
        """The limits a run's own workers start with: its budgets, the LoRA rank rounded up to
        one vLLM serves (64 under full fine-tuning). The prompt's takes no margin: the rollout
        counts a prompt as the policy's processor does (`core.prompt_counter`), to the token
        of both backends' `prompt_token_ids` (tests/rollout/test_prompt_budget.py); a prompt
        refused all the same (a tokenizer of another version where the worker runs) is sent
        once more with less history (`rollout.episode`)."""
        return cls(
            max_new_tokens=max_new_tokens,
            max_prompt_tokens=max_prompt_tokens,
            max_images=max_images,
            max_lora_rank=vllm_lora_rank(lora_rank) if lora_rank else cls.max_lora_rank,
        )

    @property
    def max_model_len(self) -> int:
        """vLLM's context: the longest prompt plus the longest reply."""
        return self.max_prompt_tokens + self.max_new_tokens

    def server_args(self) -> list[str]:
        """`rollout.server`'s flags for these limits (the vLLM adapter takes the first and the
        last). Its prompt limit is never below the default: unlike vLLM's context, which sizes
        its cache, a longer prompt costs this server nothing until one comes, and a prompt
        whose system text, instruction and current screen alone pass the run's budget is sent
        whole (`core.prompts.build_messages`)."""
        prompt = max(self.max_prompt_tokens, ServingLimits.max_prompt_tokens)
        return [
            *("--max-tokens-limit", str(self.max_new_tokens)),
            *("--max-prompt-tokens", str(prompt)),
            *("--max-images", str(self.max_images)),
        ]

    def refusals(
        self, *, max_new_tokens: int, max_prompt_tokens: int, max_images: int, lora_rank: int
    ) -> list[tuple[str, str]]:
        """(setting, why) for each of a run's settings these workers would refuse."""
        out = []
        if max_new_tokens > self.max_new_tokens:
            out.append(("rollout.max_new_tokens", f"at most {self.max_new_tokens}"))
        if max_prompt_tokens > self.max_prompt_tokens:
            out.append(("rollout.max_prompt_tokens", f"at most {self.max_prompt_tokens}"))
        if max_images > self.max_images:
            out.append(("rollout.max_images", f"at most {self.max_images}"))
        if lora_rank > self.max_lora_rank:
            out.append(("trainer.lora_rank", f"at most {self.max_lora_rank}"))
        return out


SHARED = ServingLimits()
"""The shared stack's workers (`--processes shared`, docker-compose): started with the
defaults, whatever run they serve."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM serves that holds a `rank` adapter; ValueError past the largest."""
    for served in VLLM_LORA_RANKS:
        if served >= rank:
            return served
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, got {rank}")
