"""What the interop tests share: the built-in model exported to GGUF once per session (F32, and
Q8_0 / Q4_K_M by llama.cpp's own quantizer), and a loud skip (a failure under CI) where
`make test-interop` has not built llama.cpp."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engines.zoo import resolve_model_path

TARGET = resolve_model_path("builtin:pydoc-target")


def require(found: bool, what: str) -> None:
    """At a test module's top: skip it loudly where `what` is missing, fail under CI."""
    if found:
        return
    msg = f"{what}: `make test-interop` builds it"
    if os.environ.get("CI"):
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(f"SKIPPED LOUDLY: {msg}", allow_module_level=True)


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    from engines.zoo.gguf_export import export_f32, quantize

    out = tmp_path_factory.mktemp("gguf")
    f32 = export_f32(TARGET, out / "pydoc-target-f32.gguf")
    return {"f32": f32, "q8_0": quantize(f32, out / "q8_0.gguf", "Q8_0"),
            "q4_k_m": quantize(f32, out / "q4_k_m.gguf", "Q4_K_M")}
