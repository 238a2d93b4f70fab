"""Counting the device launches of a forward pass, and planning one on the meta device.

A decode step at batch 1 is bound by its kernel launches, not by the GPU (docs/reference.md §12;
the H200 profile of benchmarks/results/gpu: about 1,000 launches a step). How many a step makes
is a property of the code, not of the GPU, so it is counted here without one:

- `count()` opens a ledger. Every aten operator that does device work is one launch (views,
  aliases, bare allocations and operators on CPU tensors are none: nothing is launched for them),
  and every Triton kernel started through `run` is one.
- `planning()` runs the kernel path on `meta` tensors: `use_triton("meta")` is true inside it,
  and `run` records a Triton launch on meta tensors without starting it. A meta forward pass then
  takes the branches a CUDA one takes (engines.kernels.on_kernel_path), allocates nothing, and
  its ledger is the launches a CUDA step would make, one per aten operator and Triton kernel.

What the count does not see: a cuBLAS call that starts two kernels (a split-K reduction) counts
one, and launches inside a library kernel are not counted. tests/kernels/test_step_launches.py
holds the per-layer bound; benchmarks/step_launches.py prints the ledger per format.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_planning: contextvars.ContextVar[bool] = contextvars.ContextVar("canary_planning", default=False)
# the open ledgers of this thread and context (a dispatch mode is per thread too)
_ledgers: contextvars.ContextVar[tuple[Ledger, ...]] = contextvars.ContextVar("canary_ledgers", default=())

# operators that launch nothing: allocations (their memory is the caching allocator's), and
# bookkeeping that changes no element
_NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "_unsafe_view", "resize_", "set_", "_reshape_alias", "contiguous"}


def planning_active() -> bool:
    return _planning.get()


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """Run the CUDA kernel path on meta tensors (see the module's docstring)."""
    token = _planning.set(True)
    try:
        yield
    finally:
        _planning.reset(token)


class Ledger:
    """Launches counted while a `count()` block is open: `total`, and by name (`by_name`, an aten
    operator's name or a Triton kernel's)."""

    def __init__(self) -> None:
        self.by_name: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def note(self, name: str) -> None:
        self.by_name[name] += 1


class _AtenCounter(TorchDispatchMode):
    def __init__(self, ledger: Ledger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # an operator that returns no tensor (promote_types, a size) or only CPU tensors (a host
        # index's arithmetic) launches nothing on the device
        made = any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
                   for t in (out if isinstance(out, (tuple, list)) else (out,)))
        if made and not (func.is_view or name in _NO_LAUNCH):
            self.ledger.note(f"aten.{name}")
        return out


@contextlib.contextmanager
def count() -> Iterator[Ledger]:
    """A ledger of the launches made inside the block (nested blocks each count theirs). Count
    under no_grad, not inference_mode: there the dispatch mode sees composite operators (to,
    contiguous) before they decompose, whether or not they copy."""
    ledger = Ledger()
    token = _ledgers.set((*_ledgers.get(), ledger))
    try:
        with _AtenCounter(ledger):
            yield ledger
    finally:
        _ledgers.reset(token)


def _kernel_name(kernel: Any) -> str:
    """A JITFunction's name, or the name of the one an Autotuner (or a Heuristics) wraps."""
    for _ in range(4):
        name = getattr(kernel, "__name__", None)
        if isinstance(name, str):
            return name
        kernel = getattr(kernel, "fn", None)
    return "triton"


def run(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs), counted in every open ledger. On meta tensors (planning())
    the launch is counted and not started: there is no device to run it."""
    for ledger in _ledgers.get():
        ledger.note(_kernel_name(kernel))
    if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
        if not planning_active():
            raise RuntimeError("a Triton kernel was given meta tensors outside engines.kernels.launches.planning()")
        return
    kernel[grid](*args, **kwargs)
