"""The engines a worker keeps loaded between config-runs: a GPU holds one or two models at once,
so the least recently used goes first. An engine's identity is its model path, its spec and its
calibration texts."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from engines.protocol import Engine
from engines.spec import OptimizationSpec

_ENGINES: OrderedDict[str, Any] = OrderedDict()
MAX_CACHED_ENGINES = 2  # a GPU holds one or two models at once


def calibration_id(calibration: list[str] | None) -> str:
    """The calibration texts (AWQ's) as one digest: part of an engine's identity and of an inputs key."""
    return hashlib.sha256("\x00".join(calibration or []).encode()).hexdigest()


def get_engine(model_path: str, spec: OptimizationSpec, calibration: list[str] | None = None,
               tokenizer: str | None = None) -> Engine:
    """tokenizer: an openai config's checked model directory (workers/job.served_model_tokenizer)."""
    from engines.registry import load_engine

    key = json.dumps([model_path, spec.model_dump(), calibration_id(calibration), tokenizer], sort_keys=True)
    if key in _ENGINES:
        _ENGINES.move_to_end(key)
        return _ENGINES[key]
    from workers.outbound import engine_options

    options = engine_options(spec) | ({"tokenizer": tokenizer} if tokenizer and spec.engine == "openai" else {})
    engine = load_engine(model_path, spec, calibration=calibration, **options)
    _ENGINES[key] = engine
    while len(_ENGINES) > MAX_CACHED_ENGINES:
        _ENGINES.popitem(last=False)
    return engine


def reset_engine_cache() -> None:
    _ENGINES.clear()
