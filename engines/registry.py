"""Backends registered by string, loaded lazily (lm-eval's registry habit): importing this
module never imports torch or an optional backend."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from engines.protocol import Engine
from engines.spec import OptimizationSpec

BACKENDS = {
    "transformers": "engines.hf:TransformersEngine",
    "reference": "engines.reference.engine:ReferenceEngine",
    "openai": "engines.openai:OpenAIEngine",
    "vllm": "engines.vllm:VLLMEngine",
}


def load_engine(model_path: str, spec: OptimizationSpec, calibration: Sequence[str] | None = None,
                **options: object) -> Engine:
    """calibration: domain texts for methods that calibrate (AWQ); never the scored samples.
    options: keyword arguments for the backend (openai: transport factories and a secret reader)."""
    spec.check_available()
    target = BACKENDS.get(spec.engine)
    if target is None:  # check_available already refused it; this guards a table mismatch
        raise ValueError(f"engine: '{spec.engine}' has no backend in this release")
    module, cls = target.split(":")
    engine_cls = getattr(importlib.import_module(module), cls)
    if spec.weights == "awq-int4" and spec.engine == "reference":  # the one backend that quantizes itself
        return engine_cls(model_path, spec, calibration=calibration, **options)
    return engine_cls(model_path, spec, **options)
