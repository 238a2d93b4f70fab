"""Shared bits for the benchmark scripts: the tiny model, held-out prompts, timing helpers."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.zoo import ARTIFACTS, resolve_model_path  # noqa: E402
from engines.zoo.corpus import read_jsonl  # noqa: E402

TARGET = str(resolve_model_path("builtin:pydoc-target"))


def heldout(n: int) -> list[str]:
    return [d.text for d in read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[:n]]


def prompts(n: int, words: int = 24) -> list[str]:
    return [" ".join(t.split()[:words]) for t in heldout(n)]


def best_of(fn, repeats: int = 3) -> float:
    """Minimum wall time of `repeats` calls, seconds (the least-disturbed run)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def median(xs):
    return statistics.median(xs) if xs else None
