"""The Dockerfiles pass hadolint; the API image installs no torch (and its requirement list is
pyproject's dependencies less the model stack); app.api.main imports and serves with the model
stack absent; every image runs as a non-root user, pins its base image and has a HEALTHCHECK."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import tomllib

from tests.conftest import ROOT
from tests.deploy.tools import hadolint

DOCKER = ROOT / "deploy/docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if not p.name.endswith(".dockerignore"))
MODEL_STACK = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "triton", "vllm"}


def _name(req: str) -> str:
    return re.split(r"[\[<>=!~; ]", req.strip(), maxsplit=1)[0].lower()


def _requirements(path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_three_images():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.api", "Dockerfile.dashboard", "Dockerfile.worker"]
    for p in DOCKERFILES:
        assert (DOCKER / f"{p.name}.dockerignore").is_file(), f"{p.name} needs its .dockerignore (the context is the repository)"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile):
    r = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_basics(dockerfile):
    text = dockerfile.read_text()
    for base in re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE):
        assert re.search(r":\d+\.\d+\.\d+", base) and "latest" not in base, f"unpinned base image {base}"
    final = text[text.rindex("\nFROM "):]
    assert re.search(r"^USER\s+10001", final, re.MULTILINE), "the final stage runs as the non-root user"
    assert "HEALTHCHECK" in final
    for line in re.findall(r"pip install[^\n]*", text):
        assert "--no-cache-dir" in line, line


def test_api_image_installs_no_torch():
    text = (DOCKER / "Dockerfile.api").read_text()
    installs = " ".join(re.findall(r"pip install[^\n]*", text))
    assert "--no-deps ." in installs and "-r /tmp/requirements-api.txt" in installs
    assert not MODEL_STACK & {_name(w) for w in installs.split()}
    api = {_name(r) for r in _requirements(DOCKER / "requirements-api.txt")}
    assert not api & MODEL_STACK, api & MODEL_STACK


def test_api_requirements_follow_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    expected = sorted(d for d in deps if _name(d) not in MODEL_STACK)
    assert sorted(_requirements(DOCKER / "requirements-api.txt")) == expected
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dashboard = {_name(r): r for r in _requirements(DOCKER / "requirements-dashboard.txt")}
    assert dashboard["streamlit"] in extras["dashboard"]
    assert dashboard["httpx"] in deps


BLOCK_MODEL_STACK = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: the API image has no model stack)")
sys.meta_path.insert(0, Absent())
"""

API_WITHOUT_TORCH = BLOCK_MODEL_STACK + """
import os
from fastapi.testclient import TestClient
from app.db import upgrade
upgrade()
from app.api.main import app as api
import app.cli as cli  # noqa: F401 - the operator CLI ships in the same image
with TestClient(api) as client:
    health = client.get("/healthz")  # the database answers; the broker (port 1) does not, so 503 names it
    assert health.status_code == 503 and set(health.json()["down"]) == {{"broker"}}, health.text
    assert client.post("/api/v1/projects", json={{"name": "p"}}).status_code == 201
    assert client.post("/api/v1/projects/p/models", json={{"name": "m", "path": "builtin:pydoc-target"}}).status_code == 201
    r = client.post("/api/v1/projects/p/configs", json={{"name": "fp16", "model": "m", "baseline": True, "engine": "reference"}})
    assert r.status_code == 201, r.text
    r = client.post("/api/v1/projects/p/suites", json={{"name": "s", "corpus": "builtin:pydoc-heldout", "samples": 12}})
    assert r.status_code == 201, r.text
    assert client.get("/metrics").status_code == 200
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
assert not loaded, loaded
print("ok")
"""


def test_api_runs_without_the_model_stack(tmp_path):
    """What the API image relies on: app.api.main, the CLI, migrations and the API's create
    paths work with torch, transformers, tokenizers, safetensors and numpy unimportable."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("CANARY_")}
    env.update({"CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'canary.db'}", "CANARY_BROKER_URL": "redis://127.0.0.1:1/0",
                "CANARY_EXECUTION": "celery"})  # as in the image: the API only enqueues
    r = subprocess.run([sys.executable, "-c", API_WITHOUT_TORCH.format(blocked=sorted(MODEL_STACK))], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_the_api_image_copies_every_project_package_the_api_imports():
    """The API image installs only the directories its Dockerfile COPYs: every module of this
    repository that the API and the CLI load must come from one of them (app reads the metric
    table, the figures, the suite settings and the term lists from vocabulary/)."""
    copied = {m.group(1).rstrip("/") for m in re.finditer(r"^COPY (?!--)(\S+) \./", (ROOT / "deploy/docker/Dockerfile.api")
                                                            .read_text(), re.M)}
    code = ("import sys, app.api.main, app.cli\n"
            "print('\\n'.join(sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)})))")
    r = subprocess.run([sys.executable, "-c", BLOCK_MODEL_STACK.format(blocked=sorted(MODEL_STACK)) + code], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    mine = {pathlib.Path(f).resolve().relative_to(ROOT).parts[0] for f in r.stdout.split()
            if pathlib.Path(f).resolve().is_relative_to(ROOT) and ".venv" not in f}
    assert mine and mine <= copied, f"the API imports from {sorted(mine - copied)}, which Dockerfile.api does not COPY"
