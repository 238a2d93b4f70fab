"""`canary engine-serve` bounds what one client can make it hold (security round 4, N4): the queue
counts sequences (prompts × n) across requests, a request bigger than the server ever admits is a
400 naming the field, a response's log-probs are capped, a body is refused past its bound before
it is read, /v1 asks for the key given with --api-key, and SIGTERM lets the requests it holds
finish within the drain deadline. Real server processes, the real `openai` SDK and httpx."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from tests.http.conftest import start_engine_serve
from tests.http.test_engine_serve_batching import MODEL, NO_EOS, gauge, heldout_prompts, stream_in_thread, wait_for

KEY = "k-bounds-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    proc, base = start_engine_serve("--served-model-name", MODEL, "--max-num-seqs", "1", "--max-queue", "4",
                                    "--max-logprob-entries", "2000", "--max-body-bytes", "200000",
                                    "--api-key", KEY)
    yield base
    proc.terminate()
    proc.wait(20)


def client(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def test_v1_asks_for_the_key_and_the_open_routes_stay_open(server):
    with pytest.raises(openai.AuthenticationError) as refused:
        client(server, key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert refused.value.status_code == 401 and "--api-key" in refused.value.body["message"]
    assert httpx.get(server + "/v1/models", timeout=10).status_code == 401  # no header at all
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    assert httpx.get(server + "/metrics", timeout=10).status_code == 200
    out = client(server).completions.create(model=MODEL, prompt="import os", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_a_request_bigger_than_the_queue_is_a_400_naming_n(server):
    with pytest.raises(openai.BadRequestError) as refused:  # 3 prompts × n=2 = 6 sequences > --max-queue 4
        client(server).completions.create(model=MODEL, prompt=["a", "b", "c"], n=2, max_tokens=2, temperature=1,
                                          seed=1)
    err = refused.value.body
    assert err["param"] == "n" and "6 sequences" in err["message"] and "--max-queue" in err["message"], err
    with pytest.raises(openai.BadRequestError) as refused:  # 5 prompts, n=1: the prompts are the field to cut
        client(server).completions.create(model=MODEL, prompt=["a"] * 5, max_tokens=2, temperature=0)
    assert refused.value.body["param"] == "prompt"


def stream_in_thread_with_key(base: str, body: dict, out: list) -> threading.Thread:
    return stream_in_thread(base, body, out, headers=AUTH)


def test_the_queue_counts_sequences_across_requests(server):
    # one request decodes (--max-num-seqs 1); a 3-prompt request waits (3 of --max-queue 4); a
    # 2-prompt request would make 5: a 429 (before: admitted, the cap counted only requests waiting);
    # a 1-prompt request makes 4 and is admitted
    long = {"model": MODEL, "prompt": "import os", "max_tokens": 400, "temperature": 0, "logit_bias": NO_EOS,
            "stream": True}
    outs: list = []
    threads = [stream_in_thread_with_key(server, long, outs)]
    wait_for(lambda: gauge(server, "num_requests_running") == 1)
    threads.append(stream_in_thread_with_key(server, {**long, "prompt": ["def f(", "class A:", "x ="],
                                                      "max_tokens": 2}, outs))
    wait_for(lambda: gauge(server, "num_requests_waiting") == 3)
    with pytest.raises(openai.RateLimitError) as refused:
        client(server).completions.create(model=MODEL, prompt=["y", "z"], max_tokens=2, temperature=0)
    assert "3 sequences wait and this request brings 2" in refused.value.body["message"], refused.value.body
    one = client(server).completions.create(model=MODEL, prompt="w", max_tokens=2, temperature=0)
    assert one.choices[0].finish_reason in ("length", "stop")
    for t in threads:
        t.join(60)
    assert [status for status, _ in outs] == [200, 200], outs


def test_log_probs_past_the_bound_are_a_400_before_any_work(server):
    ids = list(range(1, 301))
    with pytest.raises(openai.BadRequestError) as refused:  # 4 × 300 tokens × (1 + 5) = 7200 > 2000
        client(server).completions.create(model=MODEL, prompt=[ids] * 4, echo=True, logprobs=5, max_tokens=0)
    err = refused.value.body
    assert err["param"] == "prompt" and "7200 prompt log-probs" in err["message"], err
    # within the bound: 300 × (1 + 5) = 1800
    out = client(server).completions.create(model=MODEL, prompt=ids, echo=True, logprobs=5, max_tokens=0)
    assert len(out.choices[0].logprobs.top_logprobs) == 300
    with pytest.raises(openai.BadRequestError) as refused:  # generated: 2 prompts × 200 × (1 + 5) = 2400
        client(server).completions.create(model=MODEL, prompt=["a", "b"], logprobs=5, max_tokens=200,
                                          temperature=0)
    assert refused.value.body["param"] == "logprobs" and "2400" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:  # chat names the field top_logprobs: 400 × (1 + 5) = 2400
        client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               logprobs=True, top_logprobs=5, max_tokens=400)
    assert refused.value.body["param"] == "top_logprobs" and "2400" in refused.value.body["message"]


def test_a_body_past_its_bound_is_refused_before_it_is_read(server):
    big = b'{"model": "' + b"x" * 300_000 + b'"}'
    r = httpx.post(server + "/v1/completions", content=big, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text

    def chunks():  # no Content-Length: chunked, refused once it passes the bound
        for _ in range(100):
            yield b"x" * 10_000

    r = httpx.post(server + "/v1/completions", content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    # a body within the bound still reaches the route (and its own checks)
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "x" * 1000, "max_tokens": 1},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text


def test_sigterm_lets_the_requests_it_holds_finish_and_refuses_new_ones():
    proc, base = start_engine_serve("--served-model-name", MODEL, "--drain-timeout", "60")
    try:
        prompts = heldout_prompts(2)
        outs: list = []
        # answers long enough that both are still streaming when the second starts, on a loaded machine too
        threads = [stream_in_thread(base, {"model": MODEL, "prompt": p, "max_tokens": 128, "temperature": 0,
                                           "logit_bias": NO_EOS, "stream": True}, outs) for p in prompts]
        wait_for(lambda: gauge(base, "num_requests_running") == 2, seconds=60)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # a new request: the listener is closed (uvicorn), or the engine answers 503
            late = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                              timeout=10).status_code
        except httpx.ConnectError:
            late = None
        assert late in (None, 503), late
        for t in threads:
            t.join(60)
        proc.wait(60)
        took = time.perf_counter() - t0
        # both answers whole: every token streamed, the stream closed normally
        assert len(outs) == 2
        for status, lines in outs:
            assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
            assert not any("shutting down" in line for line in lines)
        assert took < 30  # it exits once they are done, not at the deadline
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_request_of_many_prompts_takes_turns_with_a_later_small_one(server):
    # --max-num-seqs 1: a 3-prompt request starts its first prompt, its other two wait; a small
    # request that comes after starts next (it has started nothing, the big one one), not after
    # every prompt of the big one, so it is answered before the big request is
    done: dict[str, float] = {}

    def big() -> None:
        r = httpx.post(server + "/v1/completions", headers=AUTH, timeout=120,
                       json={"model": MODEL, "prompt": ["import os", "def f(", "class A:"], "max_tokens": 120,
                             "temperature": 0, "logit_bias": NO_EOS})
        assert r.status_code == 200, r.text
        done["big"] = time.perf_counter()

    thread = threading.Thread(target=big, daemon=True)
    thread.start()
    wait_for(lambda: gauge(server, "num_requests_waiting") == 2)
    client(server).completions.create(model=MODEL, prompt="x =", max_tokens=2, temperature=0)
    done["small"] = time.perf_counter()
    thread.join(120)
    assert done["small"] < done["big"], done
