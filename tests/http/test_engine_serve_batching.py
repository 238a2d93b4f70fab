"""`canary engine-serve` batches like a real server: concurrent requests are decoded together in a
continuous batch, join it between steps and leave it when done or when their client goes, the
waiting queue is bounded (429), and SIGTERM ends the server promptly with a batch running. Real
server processes, the real `openai` SDK and httpx as clients, figures read from /metrics."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from engines.server_metrics import metric_sum, parse_metrics
from engines.zoo import ARTIFACTS
from engines.zoo.corpus import read_jsonl

from tests.http.conftest import start_engine_serve

MODEL = "pydoc-target"
EOS = 0  # the tiny zoo's end-of-sequence id (bos = eos = 0)
NO_EOS = {str(EOS): -100}  # a logit_bias that keeps a generation going to max_tokens


def heldout_prompts(n: int, words: int = 24) -> list[str]:
    return [" ".join(d.text.split()[:words]) for d in read_jsonl(ARTIFACTS / "pydoc-heldout.jsonl")[:n]]


@pytest.fixture(scope="module")
def server():
    proc, base = start_engine_serve("--served-model-name", MODEL)
    yield base
    proc.terminate()
    proc.wait(10)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(base: str) -> dict:
    return parse_metrics(httpx.get(base + "/metrics", timeout=10).text)


def gauge(base: str, name: str) -> float:
    return metric_sum(metrics(base), f"vllm:{name}") or 0.0


def wait_for(check, seconds: float = 10.0, every: float = 0.02) -> float:
    """Poll until check() is true; the seconds it took."""
    t0 = time.perf_counter()
    while not check():
        assert time.perf_counter() - t0 < seconds, "timed out"
        time.sleep(every)
    return time.perf_counter() - t0


class Peak:
    """The highest value of a gauge while the block runs, sampled every 10 ms."""

    def __init__(self, base: str, name: str):
        self.base, self.name, self.value = base, name, 0.0
        self._stop = threading.Event()

    def __enter__(self) -> Peak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.value = max(self.value, gauge(self.base, self.name))
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def greedy(c: openai.OpenAI, prompt: str, max_tokens: int = 24) -> tuple[str, list[str], int, list[float]]:
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0)
    choice = out.choices[0]
    return choice.text, choice.logprobs.tokens, out.usage.completion_tokens, choice.logprobs.token_logprobs


@pytest.mark.parametrize("concurrency", [8, 16])
def test_concurrent_greedy_outputs_equal_one_at_a_time(server, concurrency):
    c = client(server)
    prompts = heldout_prompts(concurrency)
    serial = [greedy(c, p) for p in prompts]
    with Peak(server, "num_requests_running") as running, ThreadPoolExecutor(concurrency) as pool:
        together = list(pool.map(lambda p: greedy(c, p), prompts))
    assert running.value > 1  # they were decoded together, not one after another
    for (text, tokens, n, lps), (text_b, tokens_b, n_b, lps_b) in zip(serial, together, strict=True):
        assert (text_b, tokens_b, n_b) == (text, tokens, n)  # token for token, and the same count
        assert max(abs(a - b) for a, b in zip(lps, lps_b, strict=True)) < 1e-4
    assert sum(n for _, _, n, _ in serial) > concurrency  # not all cut at the first token


def test_a_lossy_kv_server_batches_and_answers_as_one_at_a_time():
    # each row keeps its own TurboQuant cache (rows.DecoderRows): decoded together, the
    # answers are still those of one request at a time, and the KV gauge counts every row
    proc, base = start_engine_serve("--served-model-name", MODEL, "--kv-cache", "turbo-3")
    try:
        c = client(base)
        prompts = heldout_prompts(8)
        serial = [greedy(c, p) for p in prompts]
        with Peak(base, "num_requests_running") as running, Peak(base, "kv_cache_usage_perc") as usage, \
                ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda p: greedy(c, p), prompts))
        assert running.value > 1
        assert usage.value > 0
        for (text, tokens, n, lps), (text_b, tokens_b, n_b, lps_b) in zip(serial, together, strict=True):
            assert (text_b, tokens_b, n_b) == (text, tokens, n)
            assert max(abs(a - b) for a, b in zip(lps, lps_b, strict=True)) < 1e-4
    finally:
        proc.terminate()
        proc.wait(10)


# turbo-3 codes every key and value from the first (KIVI keeps 128 tokens raw, more than these answers hold)
@pytest.mark.parametrize("kv", [[], ["--kv-cache", "turbo-3"]], ids=["default-kv", "turbo-3"])
def test_a_speculative_server_batches_and_each_answer_and_its_acceptance_are_as_alone(kv):
    # n-gram speculative decoding in a continuous batch: each row drafts on its own, one pass
    # verifies every row's drafts; each answer, its per-request acceptance figures and the
    # server's spec_decode counters are what one request at a time gives. Over turbo-3 each row
    # keeps its own compressed cache (rows.SpeculativeRows)
    proc, base = start_engine_serve("--served-model-name", MODEL, "--speculative", '{"method": "ngram", "k": 4}',
                                    "--per-request-spec-decode-metrics", "summary", *kv)
    try:
        c = client(base)
        prompts = heldout_prompts(8)

        def ask(prompt: str) -> tuple[tuple, dict]:
            out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=0)
            choice = out.choices[0]
            return ((choice.text, choice.logprobs.tokens, out.usage.completion_tokens, choice.logprobs.token_logprobs),
                    out.model_extra["metrics"]["speculative_decoding"])

        serial = [ask(p) for p in prompts]
        before = metrics(base)
        with Peak(base, "num_requests_running") as running, ThreadPoolExecutor(8) as pool:
            together = list(pool.map(ask, prompts))
        after = metrics(base)
        assert running.value > 1  # decoded together, not one after another
        for ((text, tokens, n, lps), spec), ((text_b, tokens_b, n_b, lps_b), spec_b) in zip(serial, together,
                                                                                            strict=True):
            assert (text_b, tokens_b, n_b) == (text, tokens, n)
            assert max(abs(a - b) for a, b in zip(lps, lps_b, strict=True)) < 1e-4
            assert spec_b == spec
        steps = sum(spec["num_spec_steps"] for _, spec in together)
        accepted = sum(spec["num_accepted_draft_tokens"] for _, spec in together)
        assert steps > 0 and accepted > 0
        counted = {name: (metric_sum(after, f"vllm:{name}_total") or 0) - (metric_sum(before, f"vllm:{name}_total") or 0)
                   for name in ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens")}
        assert counted == {"spec_decode_num_drafts": steps, "spec_decode_num_accepted_tokens": accepted}
    finally:
        proc.terminate()
        proc.wait(10)


def test_seeded_sampling_with_penalties_is_the_same_inside_a_batch(server):
    # each request samples from its own generator (its seed), with its own penalties and bias: the
    # draws do not depend on which other requests share its decode steps
    c = client(server)

    def sample(i_prompt: tuple[int, str]) -> tuple[str, int]:
        i, prompt = i_prompt
        out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.9, seed=100 + i,
                                   top_p=0.95 if i % 2 else 1.0, presence_penalty=0.5 * (i % 3),
                                   frequency_penalty=0.3 if i % 4 == 1 else 0.0,
                                   logit_bias={"13": 2.0} if i % 5 == 2 else None)
        return out.choices[0].text, out.usage.completion_tokens

    jobs = list(enumerate(heldout_prompts(8)))
    serial = [sample(j) for j in jobs]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(sample, jobs)) == serial


def test_a_short_request_leaves_the_batch_long_before_a_long_one(server):
    c = client(server)
    short_prompt = heldout_prompts(3)[2]
    alone = greedy(c, short_prompt, 8)
    t0 = time.perf_counter()
    finished: dict[str, float] = {}
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "import os", "max_tokens": 600, "temperature": 0,
                            "logit_bias": NO_EOS, "stream": True}) as long:
        lines = long.iter_lines()
        for _ in range(5):  # the long one is decoding: the short one joins its batch mid-way
            assert next(line for line in lines if line).startswith("data: {")
        joined = time.perf_counter() - t0
        short = greedy(c, short_prompt, 8)
        finished["short"] = time.perf_counter() - t0
        rest = [line for line in lines if line]
        finished["long"] = time.perf_counter() - t0
    assert short[:3] == alone[:3]  # the same tokens, joining a batch mid-way at another length
    assert short[2] == 8 and rest[-1] == "data: [DONE]"
    usage = httpx.Response(200, content=rest[-2].removeprefix("data: ")).json()["usage"]
    assert usage["completion_tokens"] == 600
    # the short one left after its 8 tokens, not when the batch's long one ended
    assert finished["short"] - joined < 0.25 * (finished["long"] - joined), finished


def running_and_generated(base: str) -> tuple[float, float]:
    m = metrics(base)
    return metric_sum(m, "vllm:num_requests_running") or 0.0, metric_sum(m, "vllm:generation_tokens_total") or 0.0


def test_a_streamed_request_whose_client_leaves_stops_being_decoded(server):
    before = metrics(server)
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "import os", "max_tokens": 900, "temperature": 0,
                            "logit_bias": NO_EOS, "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line)
        assert first.startswith("data: {")
    # the connection is closed: the row leaves the batch at its next step
    took = wait_for(lambda: running_and_generated(server)[0] == 0, 5)
    _, generated = running_and_generated(server)
    time.sleep(0.3)
    assert running_and_generated(server)[1] == generated  # it no longer grows
    made = generated - (metric_sum(before, "vllm:generation_tokens_total") or 0)
    assert made < 300 and took < 2, (made, took)  # well short of the 900 asked for
    aborted = metric_sum(metrics(server), "vllm:request_success_total", finished_reason="abort")
    assert aborted == (metric_sum(before, "vllm:request_success_total", finished_reason="abort") or 0) + 1


def test_a_request_whose_client_times_out_unstreamed_is_dropped_too(server):
    before = running_and_generated(server)[1]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", timeout=0.3,
                   json={"model": MODEL, "prompt": "import os", "max_tokens": 900, "temperature": 0,
                         "logit_bias": NO_EOS})
    # the route polls for the disconnect every half second while it waits
    took = wait_for(lambda: running_and_generated(server)[0] == 0, 5)
    assert took < 2
    assert running_and_generated(server)[1] - before < 600


def stream_in_thread(base: str, body: dict, out: list, headers: dict | None = None) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=60) as r:
                out.append((r.status_code, [line for line in r.iter_lines() if line]))
        except httpx.HTTPError as e:
            out.append((None, [repr(e)]))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_full_queue_is_a_429_and_sigterm_ends_a_running_batch_promptly():
    proc, base = start_engine_serve("--served-model-name", MODEL, "--max-num-seqs", "1", "--max-queue", "2",
                                    "--drain-timeout", "0")
    try:
        long = {"model": MODEL, "prompt": "import os", "max_tokens": 900, "temperature": 0, "logit_bias": NO_EOS,
                "stream": True}
        outs: list = []
        threads = [stream_in_thread(base, long, outs)]
        wait_for(lambda: gauge(base, "num_requests_running") == 1)
        threads += [stream_in_thread(base, {**long, "prompt": p}, outs) for p in ("def f(", "class A:")]
        wait_for(lambda: gauge(base, "num_requests_waiting") == 2)
        with pytest.raises(openai.RateLimitError) as refused:
            client(base).completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0)
        err = refused.value.body
        assert refused.value.status_code == 429 and err["code"] == 429 and err["type"] == "RateLimitError"
        assert "--max-queue 2" in err["message"] and "--max-num-seqs 1" in err["message"], err
        assert gauge(base, "num_requests_running") == 1  # the refused one never reached the engine

        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert time.perf_counter() - t0 < 5  # the running request and the queued ones did not hold it up
        for t in threads:
            t.join(10)
        # every client heard: the running one an error event in its stream, the queued ones a 500
        assert len(outs) == 3
        assert all("the server is shutting down" in lines[-1] for _, lines in outs), outs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
