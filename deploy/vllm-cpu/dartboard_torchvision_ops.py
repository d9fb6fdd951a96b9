"""Declares torchvision's two detection operators before torchvision is imported, in the
`.venv-vllm` environment only (loaded from `dartboard_torchvision_ops.pth` at start-up).

PyPI's torchvision wheels are CUDA builds: under the CPU torch their compiled operators do not
load, and `import torchvision` then fails registering fake kernels for `torchvision::nms` and
`torchvision::qnms` ("operator torchvision::nms does not exist"). transformers' Qwen2-VL image
processor needs torchvision's Python transforms, which work; nothing in vLLM's Qwen-VL path
calls either operator. Declaring the two schemas (no kernel) lets the import finish; a call
would fail loudly ("no kernel registered"), never silently.
"""

import torch

LIBRARY = torch.library.Library("torchvision", "DEF")  # kept alive: dropping it undefines them
LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
