"""Rollout service: the inference servers and what stands before them, and the episode runner.

- `server` (a transformers worker), `vllm_adapter` and `vllm_command` (a vLLM one): serve
  the policy over the OpenAI chat-completions subset, reload weights without a restart;
- `router` and `router_state`: least-loaded routing over the workers and the rolling weight
  sync; `registration`: a worker that joins a router by itself;
- `asgi` and `auth`: the HTTP edge and the tokens the three servers share; `checkpoints`:
  where a worker's weights may come from; `reloads`: what a reload asks for;
  `weight_pull`: one pull of a version from the trainer's weight server (torch and
  `core` only); `weight_receive`: the transformers server's pull into a staging buffer;
  `vllm_weights`: vLLM's worker extension that pulls into vLLM's engine; `local_server`: a worker as a child process;
  `zygote`: workers forked from a process that imported them once (how every one starts);
- `client`: `PolicyClient`, what an episode calls, and the router's admin client;
- `episode`: one multi-turn episode (reset, prompt, policy, parse, step, record).

The action grammar and its parser (`core.actions`) and the prompt (`core.prompts`) live in
`core`: the trainer builds the same prompts. The env slots that run
episodes, and their Celery tasks, are `workers.slot_worker`.

May import `core` only: not `envmanager` or `training`, and never Django or Celery
(pyproject.toml's import-linter contracts).
"""
