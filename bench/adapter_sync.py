"""How long an adapter sync takes on the transformers inference server, for the LoRA
adapters of Qwen2.5-VL-3B- and -7B-shaped models: writing the published version, and the
server's in-place swap (`core.lora.swap_adapter`: read the safetensors file, copy into the
live adapter). DART's release restarts a vLLM process for every sync (minutes per worker).

    .venv/bin/python bench/adapter_sync.py [--rank 16] [--repeats 5]

The base weights are not needed for either step (the swap touches the adapter only), so the
models are built on the meta device and only their LoRA weights are real: a 7B model's
adapter fits this machine even where its 16 GB of weights would not. The drain that
precedes a swap (waiting for in-flight generations) is the request's own latency and is not
included; `tests/rollout/test_adapter_sync.py` checks that no request fails across it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: E402

from bench.realsize import SHAPES, VISION, config_of  # noqa: E402
from core.lora import ADAPTER_WEIGHTS, LoraSpec, add_adapters, swap_adapter  # noqa: E402


def adapter_model(shape: dict, spec: LoraSpec, dtype: torch.dtype) -> nn.Module:
    """The model with its adapters real (random) and every base weight on the meta device."""
    with torch.device("meta"):
        base = Qwen2_5_VLForConditionalGeneration(
            config_of(shape["text"], tie=shape["tie"], vision=VISION)
        )
    model = add_adapters(base, spec, base=ROOT)
    for name, module in model.named_modules():
        for attr in ("lora_A", "lora_B"):
            layers = getattr(module, attr, None)
            if isinstance(layers, nn.ModuleDict) and not name.endswith(attr):
                for layer in layers.values():
                    real = torch.randn(layer.weight.shape, dtype=dtype) * 0.01
                    layer.weight = nn.Parameter(real, requires_grad=False)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spec = LoraSpec(rank=args.rank, alpha=2 * args.rank)
    print("| model | adapter | dtype | size MB | write ms | swap ms (median) | swap ms (max) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, shape in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float32):
            model = adapter_model(shape, spec, dtype)
            with tempfile.TemporaryDirectory() as tmp:
                version = Path(tmp) / "v1"
                started = time.perf_counter()
                model.save_pretrained(version)  # what the trainer's save_version writes
                write_ms = (time.perf_counter() - started) * 1000
                size = (version / ADAPTER_WEIGHTS).stat().st_size
                swaps = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    swap_adapter(model, version)  # type: ignore[arg-type]
                    swaps.append((time.perf_counter() - started) * 1000)
            print(
                f"| {name} | LoRA r{args.rank} on the LM projections | "
                f"{'bf16' if dtype == torch.bfloat16 else 'fp32'} | {size / 1e6:.0f} | "
                f"{write_ms:.0f} | {statistics.median(swaps):.0f} | {max(swaps):.0f} |",
                flush=True,
            )
            del model


if __name__ == "__main__":
    main()
