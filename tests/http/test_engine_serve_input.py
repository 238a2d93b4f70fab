"""`canary engine-serve` answers bad input with a 400 in OpenAI's (vLLM's) error shape — never a
500, never a dropped connection — checked over a real socket with the real `openai` SDK as the
client, raw httpx for bodies the SDK cannot send, and a hypothesis fuzz of the POST routes.

`pytest -s` prints the fuzz's figures: cases tried and the status counts."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "pydoc-target"


@pytest.fixture(scope="module")
def client(engine_serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine_serve + "/v1", api_key="unused", max_retries=0, timeout=60)


def assert_openai_error(body: dict, status: int, param: str | None = None) -> dict:
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, body
    assert err["code"] == status and err["message"], body
    assert err["type"] in ("BadRequestError", "invalid_request_error", "NotFoundError"), body
    if param is not None:
        assert err["param"] == param, body
    return err


# (keyword arguments to completions.create beyond model and prompt, the param the error names)
BAD_COMPLETIONS = [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_p": 5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": 99}, "logprobs"),
    ({"seed": 2**70}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    # range-valid, but not implemented by the reference engine yet: refused, never ignored
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"logit_bias": {"x": 10}}, "logit_bias"),  # keys are token ids
    ({"logit_bias": {"99999": 10}}, "logit_bias"),  # … of this model's vocabulary
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 2, "stream": True}, "logprobs"),
    ({"extra_body": {"no_such_parameter": 1}}, "no_such_parameter"),
]


@pytest.mark.parametrize("kwargs,param", BAD_COMPLETIONS, ids=[p + "=" + repr(k.get(p, k.get("extra_body")))[:20] for k, p in BAD_COMPLETIONS])
def test_bad_completion_parameters_are_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="json.dumps", **kwargs)
    assert e.value.status_code == 400
    assert_openai_error(e.value.body if "error" in e.value.body else {"error": e.value.body}, 400, param)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "hi " * 3000}]}, "messages"),  # over the context
]


@pytest.mark.parametrize("kwargs,param", BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_requests_are_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, **kwargs)
    assert e.value.status_code == 400
    assert_openai_error({"error": e.value.body}, 400, param)


def test_prompt_over_the_context_and_out_of_vocabulary_ids_are_a_400(client, engine_serve):
    ctx = httpx.get(engine_serve + "/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens") as e:
        client.completions.create(model=MODEL, prompt="os.path " * ctx, max_tokens=4)
    assert e.value.body["param"] == "prompt"
    # the prompt fits but prompt + max_tokens does not: refused before any GPU time is spent
    with pytest.raises(openai.BadRequestError, match="in the completion"):
        client.completions.create(model=MODEL, prompt="json.dumps", max_tokens=ctx)
    # echo (prompt log-probs): a token-id prompt longer than the context, and ids outside the vocabulary
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[1] * (ctx + 1), echo=True, logprobs=1, max_tokens=0)
    for bad_id in (4096, 10**9, -1):
        with pytest.raises(openai.BadRequestError, match="out of vocabulary") as e:
            client.completions.create(model=MODEL, prompt=[1, 2, bad_id], echo=True, logprobs=1, max_tokens=0)
        assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):  # streaming too: a 400 before the stream
        client.completions.create(model=MODEL, prompt="os.path " * ctx, max_tokens=4, stream=True)


def test_unknown_model_is_a_404_and_good_requests_still_work(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    done = client.completions.create(model=MODEL, prompt="json.dumps", max_tokens=4, temperature=0, top_p=1, n=1, seed=3)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens <= 4
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "os.path"}]}],
                                          max_completion_tokens=4, temperature=0, logprobs=True, top_logprobs=5)
    assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].logprobs.content[0].top_logprobs) == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="json.dumps", max_tokens=4,
                                                                            temperature=0, stream=True) if c.choices)
    assert streamed == done.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=[1, 2, 3], echo=True, logprobs=1, max_tokens=0)
    assert len(echo.choices[0].logprobs.token_logprobs) == 3


RAW_BODIES = [
    (b'{"model": "pydoc-target", "prompt": "x"', "not valid JSON"),  # truncated
    (b'{"model": "pydoc-target", "prompt": "x", "temperature": NaN}', None),
    (b"[]", "JSON object"),
    (b'"a string"', "JSON object"),
    (b"null", None),
    (b"", None),
    (b"\xff\xfe\x00garbage", None),
    (b"[" * 100_000 + b"]" * 100_000, None),  # deeper than the JSON parser's recursion limit
    (json.dumps({"model": "pydoc-target", "prompt": "x", "max_tokens": 10**30}).encode(), "max_tokens"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_bodies_are_a_400_and_the_connection_stays_usable(engine_serve, path):
    with httpx.Client(base_url=engine_serve, timeout=30) as http:
        for raw, words in RAW_BODIES:
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (raw[:40], r.status_code, r.text[:200])
            err = assert_openai_error(r.json(), 400)
            if words:
                assert words in err["message"], err
        # wrong content type, and the same keep-alive connection still answers a good request
        r = http.post(path, content=b"model=pydoc-target", headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400
        assert_openai_error(r.json(), 400)
        good = http.post("/tokenize", json={"model": MODEL, "prompt": "json.dumps"})
        assert good.status_code == 200 and good.json()["count"] > 1


# -- fuzz ------------------------------------------------------------------------------------------------
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                        max_leaves=12)
SMALL_INT = st.integers(-3, 4) | st.integers(2000, 2**70) | st.integers(-(2**70), -1000)
NUMBER = st.floats(-5, 5, allow_nan=False) | st.integers(-3, 3) | st.just(1e308)
FIELD_VALUES = {
    "model": st.just(MODEL) | st.text(max_size=10) | ANY_JSON,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 5000), max_size=6) | st.just("os.path " * 1100) | ANY_JSON,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                                "content": st.text(max_size=30) | ANY_JSON}), max_size=3) | ANY_JSON,
    "max_tokens": SMALL_INT | ANY_JSON,
    "max_completion_tokens": SMALL_INT,
    "temperature": NUMBER | st.just("hot"),
    "top_p": NUMBER,
    "n": SMALL_INT,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6),
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "logit_bias": st.dictionaries(st.text(max_size=4), NUMBER, max_size=2),
    "logprobs": st.booleans() | SMALL_INT,
    "top_logprobs": SMALL_INT,
    "echo": st.booleans(),
    "seed": SMALL_INT,
    "stream": st.booleans(),
    "best_of": SMALL_INT,
    "add_special_tokens": st.booleans() | ANY_JSON,
    "no_such_field": ANY_JSON,
}
VALID_VALUES = {  # in range: these reach the engine
    "temperature": st.floats(0, 2), "top_p": st.just(1.0), "n": st.just(1), "seed": st.integers(0, 2**40),
    "max_tokens": st.integers(1, 3), "max_completion_tokens": st.integers(1, 3), "stream": st.booleans(),
    "presence_penalty": st.just(0.0), "frequency_penalty": st.just(0.0), "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5), "prompt": st.text(max_size=30), "add_special_tokens": st.booleans(),
}
BASES = {
    "/v1/completions": {"model": MODEL, "prompt": "json.dumps", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "os.path"}], "max_tokens": 2},
    "/tokenize": {"model": MODEL, "prompt": "json.dumps"},
}


def body_for(path: str) -> st.SearchStrategy:
    """Mostly a valid body with up to three fields replaced (in range or wild), sometimes any JSON."""
    def value(key: str) -> st.SearchStrategy:
        return (VALID_VALUES[key] | FIELD_VALUES[key]) if key in VALID_VALUES else FIELD_VALUES[key]

    mutated = st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: value(k) for k in keys})).map(lambda over: {**BASES[path], **over})
    return st.one_of(mutated, mutated, mutated, ANY_JSON)


FUZZ_PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize"]
FUZZ_EXAMPLES = 300  # per path; ≈ 900 requests, well under a minute with the tiny model on 2 cores


def fuzz_route(http: httpx.Client, path: str, statuses: collections.Counter, server_errors: list) -> int:
    tried = [0]

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=body_for(path), truncate=st.integers(0, 9).map(lambda i: i == 0))
    def one(body, truncate):
        raw = json.dumps(body).encode()
        if truncate:
            raw = raw[: max(1, len(raw) // 2)]  # a truncated document
        r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        tried[0] += 1
        statuses[r.status_code] += 1
        if r.status_code >= 500:
            server_errors.append((path, raw[:200], r.text[:200]))
        elif r.status_code >= 400:
            assert_openai_error(r.json(), r.status_code)
        elif "text/event-stream" in r.headers.get("content-type", ""):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]

    one()
    return tried[0]


def test_fuzzed_bodies_never_get_a_5xx(engine_serve):
    statuses: collections.Counter[int] = collections.Counter()
    server_errors: list[tuple] = []
    t0 = time.monotonic()
    with httpx.Client(base_url=engine_serve, timeout=60) as http:
        per_path = {path: fuzz_route(http, path, statuses, server_errors) for path in FUZZ_PATHS}
    took = time.monotonic() - t0
    print(f"\nengine-serve fuzz: {sum(per_path.values())} cases over {len(FUZZ_PATHS)} routes in {took:.1f} s ("
          + ", ".join(f"{p}: {n}" for p, n in per_path.items()) + ")")
    print("  status codes: " + ", ".join(f"{code}: {n}" for code, n in sorted(statuses.items())) + f"; 5xx: {len(server_errors)}")
    assert not server_errors, server_errors[:5]
    assert statuses[200] > 0 and statuses[400] > 0  # both sides of the validation were reached


@pytest.mark.parametrize("args, message", [
    (["--weights", "int5"], "argument --weights: invalid choice: 'int5' (choose from 'fp32', 'fp16'"),
    (["--speculative", "{bad"], "--speculative: not JSON"),
    (["--speculative", '{"method": "ngram", "k": 0}'], "--speculative: ngram.k: Input should be greater than or equal to 1"),
    (["--model", "builtin:nope"], "--model: unknown builtin model 'nope'; choose one of: pydoc-target"),
])
def test_a_bad_flag_is_one_line_naming_it(args, message):
    r = subprocess.run([sys.executable, "-m", "app.cli", "engine-serve", *args], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"canary engine-serve: error: {message}"), r.stderr


def test_help_lists_the_servers_options():
    r = subprocess.run([sys.executable, "-m", "app.cli", "engine-serve", "--help"], capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0
    for flag in ("--model", "--served-model-name", "--weights", "--kv-cache", "--speculative", "--port"):
        assert flag in r.stdout
    assert "awq-int4" in r.stdout and "turbo-3.5" in r.stdout  # the formats it takes


def test_echo_of_a_batch_with_the_next_token_appended_as_vllm_does(client):
    """What lm-eval's local-completions sends for log-likelihoods: token-id prompts in a batch,
    echo, logprobs 1, max_tokens 1 (it drops the last position, the generated token)."""
    out = client.completions.create(model=MODEL, prompt=[[0, 88, 581, 1933], [0, 14]], echo=True, logprobs=2,
                                    max_tokens=1, temperature=0)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 2
    for choice, n in zip(out.choices, (4, 2), strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1  # the prompt + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for position in range(1, n + 1):
            top = lp.top_logprobs[position]
            assert 1 <= len(top) <= 2 and max(top.values()) >= lp.token_logprobs[position] - 1e-6
        # the appended token is the greedy one: its log-prob is the best of its alternatives
        assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))
    # without the appended token, the same prompt log-probs
    bare = client.completions.create(model=MODEL, prompt=[0, 88, 581, 1933], echo=True, logprobs=0, max_tokens=0)
    assert bare.choices[0].logprobs.token_logprobs == pytest.approx(out.choices[0].logprobs.token_logprobs[:4])
    with pytest.raises(openai.BadRequestError) as err:  # a sampled next token is not what echo serves
        client.completions.create(model=MODEL, prompt=[0, 14], echo=True, logprobs=1, max_tokens=1, temperature=0.7)
    assert err.value.body["param"] == "temperature"


def test_model_retrieve_version_tokenizer_info_and_detokenize(client, engine_serve):
    assert client.models.retrieve(MODEL).id == MODEL  # the SDK's GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.get(engine_serve + "/version").json()["version"]
    info = httpx.get(engine_serve + "/tokenizer_info").json()
    assert info["vocab_size"] == 4096 and info["model_max_length"] == 1024
    ids = httpx.post(engine_serve + "/tokenize", json={"prompt": "os.path.join", "add_special_tokens": False}).json()
    back = httpx.post(engine_serve + "/detokenize", json={"model": MODEL, "tokens": ids["tokens"]})
    assert back.json() == {"prompt": "os.path.join"}  # byte-level BPE round-trips
    bad = httpx.post(engine_serve + "/detokenize", json={"tokens": [5, 99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_stop_strings_and_token_ids_cut_the_text_as_vllm_does(client, engine_serve):
    full = client.completions.create(model=MODEL, prompt="os.path.join(a, b)\n\nJoin", max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert len(text) > 6
    stop = text[3:6]  # a piece from inside the greedy continuation
    cut = client.completions.create(model=MODEL, prompt="os.path.join(a, b)\n\nJoin", max_tokens=24, temperature=0,
                                    stop=[stop, "never appears"])
    expected = text[: text.find(stop)]
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.model_extra is not None and cut.choices[0].model_extra["stop_reason"] == stop
    # streamed: the same text, held back where a stop string may begin, never past it
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt="os.path.join(a, b)\n\nJoin", max_tokens=24,
                                           temperature=0, stop=stop, stream=True):
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(pieces) == expected and finish == "stop"
    # a stop token id: the text ends before that token
    ids = httpx.post(engine_serve + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    by_id = client.completions.create(model=MODEL, prompt="os.path.join(a, b)\n\nJoin", max_tokens=24, temperature=0,
                                      extra_body={"stop_token_ids": [ids[2]]})
    assert by_id.choices[0].finish_reason == "stop" and text.startswith(by_id.choices[0].text)
    assert len(by_id.choices[0].text) < len(text) and by_id.choices[0].model_extra["stop_reason"] == ids[2]


def test_n_choices_each_with_its_own_seed(client):
    greedy = client.completions.create(model=MODEL, prompt="json.dumps", max_tokens=6, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1  # greedy: the same three times
    sampled = client.completions.create(model=MODEL, prompt="json.dumps", max_tokens=12, temperature=1.5, n=4, seed=7)
    assert len({c.text for c in sampled.choices}) > 1 and sampled.usage.completion_tokens <= 48
    again = client.completions.create(model=MODEL, prompt="json.dumps", max_tokens=12, temperature=1.5, n=4, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seeded: reproducible
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "os.path"}], max_tokens=4,
                                          n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]


def test_metrics_carry_vllm_v1_names_types_labels_and_buckets(client, engine_serve):
    """As vLLM V1's PrometheusStatLogger writes them: every series labelled model_name and engine,
    requests counted by finish reason (echo requests too), the phase histograms with vLLM's buckets,
    and the cache config as an info gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        return {f.name: f for f in text_string_to_metric_families(httpx.get(engine_serve + "/metrics").text)}

    def total(families: dict, name: str, sample: str, **labels) -> float:
        return sum(s.value for s in families[name].samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))

    before = scrape()
    client.completions.create(model=MODEL, prompt="json.dumps", max_tokens=3, temperature=0)
    client.completions.create(model=MODEL, prompt=[0, 14, 88], echo=True, logprobs=0, max_tokens=0)
    after = scrape()
    kinds = {"vllm:request_success": "counter", "vllm:request_prompt_tokens": "histogram",
             "vllm:request_generation_tokens": "histogram", "vllm:iteration_tokens_total": "histogram",
             "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
             "vllm:request_decode_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
             "vllm:e2e_request_latency_seconds": "histogram", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:time_per_output_token_seconds": "histogram", "vllm:request_params_max_tokens": "histogram",
             "vllm:request_params_n": "histogram", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
             "vllm:num_requests_running": "gauge", "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge"}
    for name, kind in kinds.items():
        assert after[name].type == kind, name
        assert all(s.labels.get("engine") == "0" for s in after[name].samples), name
        assert name == "vllm:cache_config_info" or all(s.labels.get("model_name") == MODEL
                                                      for s in after[name].samples), name
    # two requests finished: the generation and the echo, each its reason
    done = (total(after, "vllm:request_success", "vllm:request_success_total")
            - total(before, "vllm:request_success", "vllm:request_success_total"))
    assert done == 2
    assert {s.labels["finished_reason"] for s in after["vllm:request_success"].samples} >= {"stop", "length", "abort"}
    echo_prompt = 3
    grown = (total(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total")
             - total(before, "vllm:prompt_tokens", "vllm:prompt_tokens_total"))
    assert grown >= echo_prompt + 2  # the echo's 3 tokens count, with the generation's prompt
    ttft_buckets = [s.labels["le"] for s in after["vllm:time_to_first_token_seconds"].samples
                    if s.name.endswith("_bucket")]
    assert ttft_buckets[-4:] == ["160.0", "640.0", "2560.0", "+Inf"]  # vLLM's TTFT buckets
    prompt_buckets = [s.labels["le"] for s in after["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert prompt_buckets == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "+Inf"]
    (info,) = after["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["cache_dtype"] == "auto"


def test_top_k_and_top_p_sample_only_among_the_tokens_they_keep(client, engine_serve):
    """vLLM's sampler order: temperature, then top-k, then top-p (engines/sampling.py). With top_k 1,
    or a nucleus so small that it holds only the most likely token, sampling is greedy; with top_k 3
    every first token is one of the three most likely after the prompt (from echo's top_logprobs)."""
    prompt = "os.path.join(a, b)\n\nJoin"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.5, seed=1,
                                    extra_body={"top_k": 1}).choices[0].text
    tiny = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.5, seed=1,
                                     top_p=1e-6).choices[0].text
    assert one == greedy == tiny
    ids = httpx.post(engine_serve + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    scored = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=3, max_tokens=1, temperature=0)
    top3 = set(scored.choices[0].logprobs.top_logprobs[-1])  # the three most likely next tokens, as text
    firsts = {client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=2.0, seed=seed,
                                        extra_body={"top_k": 3}).choices[0].text for seed in range(40)}
    assert firsts <= top3 and len(firsts) >= 2  # sampled, and only among the three


def test_generated_tokens_log_probs_agree_with_scoring_the_same_tokens(client, engine_serve):
    """logprobs on a completion (and on chat) give each generated token's log-prob under the model;
    scoring prompt + output teacher-forced (echo) gives the same numbers."""
    prompt = "os.path.join(a, b)\n\nJoin"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6 and "".join(lp.tokens) == out.text
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and token_lp == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the best one
    prompt_ids = httpx.post(engine_serve + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    out_ids = httpx.post(engine_serve + "/tokenize", json={"prompt": out.text, "add_special_tokens": False}).json()
    echo = client.completions.create(model=MODEL, prompt=prompt_ids + out_ids["tokens"], echo=True, logprobs=0,
                                     max_tokens=0).choices[0].logprobs.token_logprobs
    if len(out_ids["tokens"]) == 6:  # the text re-tokenizes to the same tokens (byte-level BPE, almost always)
        assert echo[len(prompt_ids):] == pytest.approx(lp.token_logprobs, abs=1e-4)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "os.path"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2).choices[0]
    content = chat.logprobs.content
    assert len(content) == 3 and "".join(c.token for c in content) == chat.message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 and c.bytes == list(c.token.encode()) for c in content)


def test_logit_bias_and_penalties_change_what_is_picked(client):
    prompt = "os.path.join(a, b)\n\nJoin"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    # +100 on one token: greedy picks it every time
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={"281": 100}, logprobs=0).choices[0]
    assert len(set(forced.logprobs.tokens)) == 1 and forced.text == forced.logprobs.tokens[0] * 4
    # a long greedy run of the tiny model repeats itself; a frequency penalty breaks the repetition
    long = client.completions.create(model=MODEL, prompt="json", max_tokens=40, temperature=0, logprobs=0).choices[0]
    penalised = client.completions.create(model=MODEL, prompt="json", max_tokens=40, temperature=0, logprobs=0,
                                          frequency_penalty=2.0, presence_penalty=1.0).choices[0]
    repeats = len(long.logprobs.tokens) - len(set(long.logprobs.tokens))
    assert repeats > 0 and penalised.text != long.text
    assert len(penalised.logprobs.tokens) - len(set(penalised.logprobs.tokens)) < repeats
    # −100 on every token the plain run picked: none of them comes first
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(i): -100 for i in ids_of(client, plain.choices[0].text)})
    assert banned.choices[0].text != first


def ids_of(client, text: str) -> list[int]:
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    return httpx.post(root + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_a_batch_of_text_prompts_gives_each_prompts_choices_in_order(client):
    one = [client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0).choices[0].text
           for p in ("json.dumps", "os.path")]
    batch = client.completions.create(model=MODEL, prompt=["json.dumps", "os.path"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [one[0], one[0], one[1], one[1]]


def test_token_id_prompts_generate_as_given(client):
    """A prompt of token ids (what lm-eval's local-completions sends for generate_until) is used as
    given, as vLLM takes it: the start token and a text's ids give that text's greedy answer."""
    texts = ["json.dumps", "os.path"]
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    ids = [httpx.post(root + "/tokenize", json={"prompt": t, "add_special_tokens": True}).json()["tokens"]
           for t in texts]  # the start token, then the text's
    assert [i[1:] for i in ids] == [ids_of(client, t) for t in texts]
    by_text = [client.completions.create(model=MODEL, prompt=t, max_tokens=4, temperature=0) for t in texts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [r.choices[0].text for r in by_text]
    assert by_ids.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in by_text) == len(ids[0]) + len(ids[1])
    # without the start token the model sees another prompt; its answer is its own (not the text's)
    one = client.completions.create(model=MODEL, prompt=ids[0][1:], max_tokens=4, temperature=0)
    assert one.usage.prompt_tokens == len(ids[0]) - 1
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt=ids[1], max_tokens=4, temperature=0, stream=True) if chunk.choices)
    assert streamed == by_text[1].choices[0].text
    with pytest.raises(openai.BadRequestError) as err:  # ids outside the vocabulary, naming the batch entry
        client.completions.create(model=MODEL, prompt=[ids[0], [0, 10**6]], max_tokens=3)
    assert err.value.body["param"] == "prompt" and "prompt[1]" in err.value.body["message"]
