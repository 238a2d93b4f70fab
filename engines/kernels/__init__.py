"""The project's Triton kernels, with torch references beside them, and the dispatch switch.

CANARY_KERNELS = auto (default: Triton on CUDA, torch elsewhere) | triton (force Triton; on a
CPU host this needs TRITON_INTERPRET=1, the interpreter) | torch (force the torch path).
On the meta device, under auto, the kernel path is taken inside launches.planning() only (a step
planned and counted without a GPU). CANARY_FUSED_STEP = on (default) | off: whether a one-token step on
the kernel path takes the fused operators of fused.py (off: the unfused operators around the
same attention kernels, the peer of benchmarks/step_launches.py and of an A/B run on a GPU).
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
    if mode == "auto" and str(device) == "meta":
        from engines.kernels.launches import planning_active

        return planning_active()
    if mode == "triton":
        if str(device).startswith("cpu") and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("CANARY_KERNELS=triton on a CPU tensor needs TRITON_INTERPRET=1 "
                               "(the Triton interpreter)")
        return True
    return str(device).startswith("cuda")


def fused_step_enabled() -> bool:
    mode = os.environ.get("CANARY_FUSED_STEP", "on")
    if mode not in ("on", "off"):
        raise ValueError(f"CANARY_FUSED_STEP: '{mode}' is not one of on, off")
    return mode == "on"


def on_kernel_path(t: torch.Tensor) -> bool:
    """Whether `t` takes the CUDA branch of a kernel wrapper: on CUDA, or on meta inside
    launches.planning() (a CUDA step counted without a GPU)."""
    if t.is_cuda:
        return True
    from engines.kernels.launches import planning_active

    return t.is_meta and planning_active()


@functools.lru_cache
def fp8_native(device: str) -> bool:
    """Whether Triton's fp8 (e4m3) type compiles for `device`: CUDA compute capability ≥ 8.9
    (Ada, Hopper; an A100 refuses it), or the interpreter on CPU."""
    if not device.startswith("cuda"):
        return True
    import torch

    return torch.cuda.get_device_capability(device) >= (8, 9)
