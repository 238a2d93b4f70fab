"""Which torch device an engine runs on (shared by every torch backend)."""

from __future__ import annotations

import torch

from engines.spec import OptimizationSpec


class EngineLoadError(RuntimeError):
    """A config that cannot load on this worker (missing device, unreadable model)."""


def resolve_device(spec: OptimizationSpec) -> torch.device:
    """engine_options.device, else CUDA when present; a CUDA request on a CPU-only worker fails."""
    want = spec.option("device")
    if want is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(want).startswith("cuda") and not torch.cuda.is_available():
        raise EngineLoadError(f"engine_options.device: '{want}' requested but this worker has no CUDA device")
    return torch.device(want)
