"""The package a user installs: a wheel built from the checkout, installed into a fresh virtual
environment with only its declared dependencies (after the pinned CPU torch, as the README's
commands install it), runs `canary db upgrade`, `canary demo` to its verdict and `canary serve`,
from a folder outside the checkout. The zoo, the migrations and the dashboard travel inside it.

Run apart (`make test-package`, about 4 minutes on 2 cores): the default `make test` does not
collect this folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile

import httpx
import pytest

from tests.conftest import ROOT
from tests.deploy.test_cli_install import SKIP
from tests.loopback import free_port

TORCH = os.environ.get("TORCH", "torch==2.13.0")  # the Makefile's pin: an unpinned torch pulls a CUDA build


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh environment's bin folder, its environment variables, a working folder outside the checkout)."""
    tmp = tmp_path_factory.mktemp("package")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=SKIP)  # the tracked tree, without this checkout's builds and environments
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(src)], check=True, timeout=600)
    [wheel] = (tmp / "dist").glob("inference_canary-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for inside in ("engines/zoo/artifacts/pydoc-target/model.safetensors", "engines/zoo/artifacts/pydoc-heldout.jsonl",
                   "migrations/env.py", "dashboard/app.py"):
        assert inside in names, f"{inside} is not in the wheel"
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True, timeout=900)
    subprocess.run([*pip, str(wheel)], check=True, timeout=900)  # its declared dependencies only
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CANARY_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", CANARY_DATABASE_URL=f"sqlite:///{work / 'c.db'}")
    return venv / "bin", env, work


def canary(installed, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    bin_dir, env, work = installed
    return subprocess.run([str(bin_dir / "canary"), *args], cwd=work, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_installed_package_imports_from_its_environment_not_the_checkout(installed):
    bin_dir, env, work = installed
    r = subprocess.run([str(bin_dir / "python"), "-c", "import app, engines; print(app.__file__, engines.__file__)"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(ROOT) not in r.stdout and "site-packages" in r.stdout, r.stdout


def test_db_upgrade_then_the_demo_to_its_verdict(installed):
    r = canary(installed, "db", "upgrade")
    assert r.returncode == 0, r.stderr[-3000:]
    r = canary(installed, "demo", "--samples", "4", "--json", "--database-url", "sqlite:///demo.db", timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["status"] == "done" and out["verdict"] in ("pass", "warn", "fail", "inconclusive"), out["verdict"]
    assert all(c["status"] == "succeeded" for c in out["configs"]), [(c["config"], c["error"]) for c in out["configs"]]
    assert len(out["configs"]) == 15 and {c["metric"] for c in out["comparisons"]} >= {"ppl_ratio"}


def test_serve_answers_health_and_the_api(installed):
    bin_dir, env, work = installed
    port = free_port()
    log = open(work / "serve.log", "w")
    proc = subprocess.Popen([str(bin_dir / "canary"), "serve", "--port", str(port)], cwd=work, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (work / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/api/v1/projects", timeout=10).status_code == 200
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)
