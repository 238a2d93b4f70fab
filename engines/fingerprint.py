"""Digests of what decides an engine's outputs: a model directory by content, and source code by
content. Equal digests mean equal inputs, so a result computed once can stand for a later one:
the AWQ search's cache (engines/reference/awq.py) and a gate's reused baseline
(workers/baseline_reuse.py) are keyed by them. Torch-free."""

from __future__ import annotations

import hashlib
import pathlib
from functools import cache

_CHUNK = 1 << 20


def _file_digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@cache
def _cached_file_digest(path: str, size: int, mtime_ns: int) -> str:
    """Keyed by the file's size and modification time too: a file rewritten in place is read again,
    one left alone is hashed once per process (a 16 GB checkpoint takes tens of seconds)."""
    return _file_digest(pathlib.Path(path))


def model_digest(model_dir: str | pathlib.Path, patterns: tuple[str, ...] = ("*",)) -> str:
    """sha256 over the directory's files matching `patterns` (name and content, in name order;
    hidden files and subfolders left out): the same model copied elsewhere has the same digest, a
    retrained checkpoint at the same path another."""
    root = pathlib.Path(model_dir)
    files = sorted({f for pattern in patterns for f in root.glob(pattern)
                    if f.is_file() and not f.name.startswith(".")})
    h = hashlib.sha256()
    for f in files:
        stat = f.stat()
        h.update(f"{f.name} {_cached_file_digest(str(f.resolve()), stat.st_size, stat.st_mtime_ns)}\n".encode())
    return h.hexdigest()


WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "config.json")  # what decides a model's outputs


def weights_digest(path: str | pathlib.Path) -> str | None:
    """sha256 of a model as it was loaded: a directory's weight files and config (model_digest over
    WEIGHTS, top level), or a single weights file (a GGUF) by its content; None when the directory
    holds none of them (its weights lie elsewhere: no digest rather than the digest of nothing). The
    release report names it. Each file is read once per process (tens of seconds for a 16 GB one)."""
    p = pathlib.Path(path)
    if p.is_file():
        stat = p.stat()
        return _cached_file_digest(str(p.resolve()), stat.st_size, stat.st_mtime_ns)
    if not any(f.is_file() for pattern in WEIGHTS if pattern != "config.json" for f in p.glob(pattern)):
        return None
    return model_digest(p, WEIGHTS)


@cache
def source_digest(*packages: pathlib.Path) -> str:
    """sha256 over the .py files of `packages` (relative name and content), read once per process:
    the code this process imported (an edit on disk after that is not the code that runs here)."""
    h = hashlib.sha256()
    for package in packages:
        package = pathlib.Path(package).resolve()
        for f in sorted(package.rglob("*.py")):
            h.update(f"{package.name}/{f.relative_to(package)}\n".encode() + f.read_bytes())
    return h.hexdigest()
