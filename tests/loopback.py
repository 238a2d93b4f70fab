"""Real servers on loopback for the tests: free ports, waiting for readiness, an ASGI app on a
thread, and `canary serve` as a subprocess."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import httpx
import uvicorn

from tests.conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def refused_port():
    """A loopback port that refuses connections for as long as the block runs: bound, never listening.
    A port from free_port() is free only for a moment; another test's server may take it, and a client
    meant to find nothing there then talks to that server instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{open(log).read()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not up after {timeout}s:\n{open(log).read()[-3000:]}")


def serve_in_thread(app, port: int) -> uvicorn.Server:
    """An ASGI app under uvicorn on a daemon thread; set .should_exit to stop it."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    return server


@contextlib.contextmanager
def canary_serve_process(env: dict[str, str], log: str, *args: str):
    """`canary serve` on a free port with `env`; yields (base URL http://127.0.0.1:PORT, the process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), *args], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, log)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@contextlib.contextmanager
def canary_serve(env: dict[str, str], log: str, *args: str):
    """`canary serve` on a free port with `env`; yields the base URL (http://127.0.0.1:PORT)."""
    with canary_serve_process(env, log, *args) as (url, _):
        yield url
