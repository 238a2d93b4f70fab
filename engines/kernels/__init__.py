"""The project's Triton kernels, with torch references beside them, and the dispatch switch.

CANARY_KERNELS = auto (default: Triton on CUDA, torch elsewhere) | triton (force Triton; on a
CPU host this needs TRITON_INTERPRET=1, the interpreter) | torch (force the torch path).
Importing this package never imports Triton; the kernel modules do, on first use.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def kernel_mode() -> str:
    mode = os.environ.get("CANARY_KERNELS", "auto")
    if mode not in ("auto", "triton", "torch"):
        raise ValueError(f"CANARY_KERNELS: '{mode}' is not one of auto, triton, torch")
    return mode


def use_triton(device: str | torch.device) -> bool:
    """Whether the Triton kernels run for tensors on `device`."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        if str(device).startswith("cpu") and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("CANARY_KERNELS=triton on a CPU tensor needs TRITON_INTERPRET=1 "
                               "(the Triton interpreter)")
        return True
    return str(device).startswith("cuda")


@functools.lru_cache
def fp8_native(device: str) -> bool:
    """Whether Triton's fp8 (e4m3) type compiles for `device`: CUDA compute capability ≥ 8.9
    (Ada, Hopper; an A100 refuses it), or the interpreter on CPU."""
    if not device.startswith("cuda"):
        return True
    import torch

    return torch.cuda.get_device_capability(device) >= (8, 9)
