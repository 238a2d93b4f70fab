"""Real HTTP servers on loopback: `canary engine-serve` processes (the reference engine behind
an OpenAI-compatible API) and a scripted OpenAI-compatible judge (tests/http/scripted.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT
from tests.loopback import free_port, serve_in_thread


def start_engine_serve(*args: str, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """`canary engine-serve *args` from the checkout at `root` (another commit's, for a benchmark's
    peer), once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "engine-serve", "--port", str(port), *args], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine-serve exited: {proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("engine-serve did not come up in 120 s")


def serving(*args: str):
    """A fixture's body: `canary engine-serve *args` for the fixture's scope; yields its base URL."""
    proc, base = start_engine_serve(*args)
    yield base
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def engine_serve():
    yield from serving("--served-model-name", "pydoc-target")


@pytest.fixture(scope="module")
def engine_serve_ngram():
    proc, base = start_engine_serve("--served-model-name", "pydoc-ngram", "--speculative", '{"method": "ngram", "k": 4}',
                                    "--no-prompt-logprobs")
    yield base
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def judge_server():
    from tests.http.scripted import ScriptedJudge

    judge = ScriptedJudge()
    port = free_port()
    server = serve_in_thread(judge.app, port)
    judge.base_url = f"http://127.0.0.1:{port}/v1"
    yield judge
    server.should_exit = True


@pytest.fixture
def receiver():
    from tests.http.receiver import Receiver

    r = Receiver()
    r.port = free_port()
    r.server = serve_in_thread(r.app, r.port)
    r.url = f"http://127.0.0.1:{r.port}"
    yield r
    r.server.should_exit = True
