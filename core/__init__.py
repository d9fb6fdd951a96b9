"""The core every layer shares: the contracts that cross the layers, and the model code the
rollout service and the trainer both run, so both see the same prompts, tokens and losses.

- contracts: `protocol` (the `Env` protocol, `Action`, `Observation`), `steps` (a step as
  every layer hands it on), `completion` (one assistant turn as a policy server answered it),
  `samples` (what crosses the database -> trainer boundary, and the metrics sent back);
- the policy's language: `actions` (the UI-TARS action grammar and its parser), `prompts`
  (the prompt builder), `encoding` (prompts and replies as tokens), `replies` (where a reply
  ends), `imaging` (the image a Qwen-VL policy sees and its coordinate bounds);
- the model: `policy` (loading and saving a checkpoint), `lora` (adapters), `generation`
  (sampling and scoring), `vision_attention`, and `losses` (the trainer's loss functions,
  pure);
- `artifacts` (checkpoints in object storage), `weight_wire` (how a version's weights travel
  from the trainer's weight server to an inference worker over torch.distributed, and how
  both check them), `procutil` (process helpers) and `redact` (secrets out of text that
  leaves its process).

The bottom layer: imports nothing first-party, and never Django or Celery (pyproject.toml's
import-linter contracts).
"""
