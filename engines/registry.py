"""Backends registered by string, loaded lazily (lm-eval's registry habit): importing this
module never imports torch or an optional backend."""

from __future__ import annotations

import importlib

from engines.protocol import Engine
from engines.spec import OptimizationSpec

BACKENDS = {
    "transformers": "engines.hf:TransformersEngine",
    "reference": "engines.reference.engine:ReferenceEngine",
}


def load_engine(model_path: str, spec: OptimizationSpec) -> Engine:
    spec.check_available()
    target = BACKENDS.get(spec.engine)
    if target is None:  # check_available already refused it; this guards a table mismatch
        raise ValueError(f"engine: '{spec.engine}' has no backend in this release")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(model_path, spec)
