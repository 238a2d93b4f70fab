"""The tiny model zoo (built by ``python -m engines.zoo.build``), addressed as ``builtin:NAME``.

Torch-free: the service resolves and checks model paths through this module.
"""

from __future__ import annotations

import pathlib

ARTIFACTS = pathlib.Path(__file__).parent / "artifacts"
BUILTIN_MODELS = ("pydoc-target", "pydoc-draft")
BUILTIN_CORPORA = {"pydoc-heldout": ARTIFACTS / "pydoc-heldout.jsonl"}


class ModelPathError(ValueError):
    pass


def resolve_model_path(ref: str) -> pathlib.Path:
    """'builtin:pydoc-target' or a local HF directory → an existing directory with config.json."""
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in BUILTIN_MODELS:
            raise ModelPathError(f"unknown builtin model '{name}'; choose one of: {', '.join(BUILTIN_MODELS)}")
        path = ARTIFACTS / name
        if not (path / "config.json").is_file():
            raise ModelPathError(f"builtin model '{name}' is not built; run: python -m engines.zoo.build")
        return path
    path = pathlib.Path(ref).expanduser()
    if not path.is_dir():
        raise ModelPathError(f"model directory '{ref}' does not exist; give a local HF directory or builtin:pydoc-target")
    if not (path / "config.json").is_file():
        raise ModelPathError(f"model directory '{ref}' has no config.json; it must be a Hugging Face model directory")
    return path


def resolve_corpus_path(ref: str) -> pathlib.Path:
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in BUILTIN_CORPORA:
            raise ModelPathError(f"unknown builtin corpus '{name}'; choose one of: {', '.join(BUILTIN_CORPORA)}")
        return BUILTIN_CORPORA[name]
    return pathlib.Path(ref).expanduser()
