"""`canary serve` on the embedded default: uvicorn on loopback, SQLite, tasks on the API
process's background thread. A client drives a run to its verdict over real HTTP."""

import os
import time

import httpx
import pytest

from tests.loopback import canary_serve

pytestmark = pytest.mark.integration  # a uvicorn server and a run to its verdict


@pytest.fixture
def server(tmp_path):
    env = {**os.environ, "CANARY_DATABASE_URL": f"sqlite:///{tmp_path / 'api.db'}", "CANARY_EXECUTION": "inline",
           "CANARY_URL_ALLOWLIST": "127.0.0.1:*,localhost:*,hooks.slack.test,hooks.test,hooks.test:8443"}  # test hosts that do not resolve
    env.pop("CANARY_BROKER_URL", None)
    log = str(tmp_path / "api.log")
    with canary_serve(env, log) as base:
        yield httpx.Client(base_url=f"{base}/api/v1", timeout=30), log


def test_embedded_server_runs_to_verdict(server):
    http, log = server
    assert http.post("/projects", json={"name": "e"}).status_code == 201
    assert http.post("/projects/e/models", json={"name": "tiny", "path": "builtin:pydoc-target"}).status_code == 201
    assert http.post("/projects/e/configs", json={"name": "fp16", "model": "tiny", "baseline": True}).status_code == 201
    assert http.post("/projects/e/configs", json={"name": "int8", "model": "tiny", "weights": "int8"}).status_code == 201
    docs = [{"id": f"d{i}", "text": f"os.path.join() joins {i} path components intelligently. " * 3} for i in range(10)]
    r = http.post("/projects/e/suites", json={"name": "s", "documents": docs, "samples": 10, "generation": {"prompts": 1, "max_new_tokens": 3}})
    assert r.status_code == 201, r.text
    # long-context documents: 10 of 171 characters (+2 between) join into documents of ≥ 64 × 6 = 384: three
    # of three, then the tenth, too short alone, joins the last
    long = http.post("/projects/e/suites", json={"name": "long", "documents": docs, "samples": 3,
                                                 "perplexity": {"window": 64, "long_documents": True}})
    assert long.status_code == 201 and long.json()["n_documents"] == 3, long.text
    too_many = http.post("/projects/e/suites", json={"name": "long2", "documents": docs, "samples": 4,
                                                     "perplexity": {"window": 64, "long_documents": True}})
    assert too_many.status_code == 422 and "samples: 4 > 3 documents (long documents joined from 10)" in too_many.text
    rag = [{**d, "reference": "an answer", "contexts": ["a passage"]} for d in docs]
    refused = http.post("/projects/e/suites", json={"name": "rag", "documents": rag, "samples": 1,
                                                    "perplexity": {"long_documents": True}})
    assert refused.status_code == 422 and "perplexity.long_documents: the corpus's documents carry" in refused.text
    run = http.post("/projects/e/runs", json={"suite": "s"}).json()
    deadline = time.monotonic() + 120
    while run["status"] not in ("done", "failed") and time.monotonic() < deadline:
        time.sleep(0.3)
        run = http.get(f"/projects/e/runs/{run['run_id']}").json()
    assert run["status"] == "done", open(log).read()[-2000:]
    [ratio] = [c for c in run["comparisons"] if c["metric"] == "ppl_ratio"]
    assert ratio["config"] == "int8" and ratio["n"] == 10
    assert ratio["verdict"] == "ok"  # int8 on 10 documents: the CI sits far inside 1.15
    assert run["verdict"] == "inconclusive"  # one prompt is too few to decide TTFT
    assert http.get("/projects/e/runs").json()[0]["run_id"] == run["run_id"]


@pytest.mark.parametrize("threads", [3, 8])
def test_route_threads_per_process_follow_the_setting(sqlite_env, monkeypatch, threads):
    """CANARY_API_THREADS caps the threads that run route handlers in the server's event loop."""
    import anyio.to_thread
    from app.api.main import app
    from app.settings import get_settings
    from fastapi.testclient import TestClient

    monkeypatch.setenv("CANARY_API_THREADS", str(threads))
    get_settings.cache_clear()
    with TestClient(app) as client:
        assert client.portal.call(lambda: anyio.to_thread.current_default_thread_limiter().total_tokens) == threads
        assert client.get("/api/v1/metrics").status_code == 200


def test_at_most_api_threads_requests_are_inside_the_app_at_once(monkeypatch):
    """InFlightLimit: 10 requests at once against an app that yields mid-request; never more than
    CANARY_API_THREADS (3) inside it, all 10 answered, in arrival order of entry."""
    import asyncio

    from app.api.limits import InFlightLimit
    from app.settings import get_settings

    monkeypatch.setenv("CANARY_API_THREADS", "3")
    get_settings.cache_clear()
    # a background thread of an earlier test in this process (an embedded server's task thread) may be
    # inside get_settings() with the old environment and cache its result after the clear: clear until
    # the setting reads back (functools.lru_cache stores a result computed across a cache_clear)
    for _ in range(100):
        if get_settings().api_threads == 3:
            break
        get_settings.cache_clear()
        time.sleep(0.01)
    inside, peak, order = 0, 0, []

    async def app(scope, receive, send):
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        order.append(scope["i"])
        await asyncio.sleep(0.01)
        inside -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})

    limited = InFlightLimit(app)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def main():
        await asyncio.gather(*(limited({"type": "http", "i": i}, None, send) for i in range(10)))

    asyncio.run(main())
    get_settings.cache_clear()
    assert peak == 3 and len(sent) == 10 and order == list(range(10))
