"""engines/openai against `canary engine-serve` over loopback: a real server, real HTTP. Its
figures are checked against the reference engine run in-process on the same inputs and against
what the server itself recorded on /metrics."""

from __future__ import annotations

import httpx
import pytest
from engines.openai import EndpointError, OpenAIEngine
from engines.protocol import GenerationRequest, RollingRequest, WindowSpec
from engines.reference.engine import ReferenceEngine
from engines.server_metrics import metric_sum, parse_metrics
from engines.spec import OptimizationSpec
from engines.zoo import resolve_model_path

TARGET = str(resolve_model_path("builtin:pydoc-target"))
DOCS = [
    RollingRequest("join", "os.path.join(a, *p)\n\nJoin two or more pathname components, inserting '/' as needed.", WindowSpec(16, 8)),
    RollingRequest("dumps", "json.dumps(obj)\n\nSerialize obj to a JSON formatted str.", WindowSpec(64, 64)),
]


def openai_spec(base: str, **opts) -> OptimizationSpec:
    return OptimizationSpec(engine="openai", weights="fp32", engine_options={"base_url": base + "/v1", **opts})


def test_perplexity_over_http_equals_the_in_process_engine(engine_serve):
    # same model, same tokens, same strided windows (16 wide, stride 8): same log-probs
    remote = OpenAIEngine("pydoc-target", openai_spec(engine_serve)).loglikelihood_rolling(DOCS)
    local = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32")).loglikelihood_rolling(DOCS)
    for r, l in zip(remote, local, strict=True):
        assert r.token_ids == l.token_ids
        assert len(r.logprobs) == len(l.token_ids)  # every token scored exactly once
        assert max(abs(a - b) for a, b in zip(r.logprobs, l.logprobs, strict=True)) < 1e-4


def test_streaming_generation_and_ttft_against_the_servers_own_record(engine_serve):
    engine = OpenAIEngine("pydoc-target", openai_spec(engine_serve, concurrency=2))
    before = parse_metrics(httpx.get(engine_serve + "/metrics").text)
    reqs = [GenerationRequest(f"r{i}", p, max_new_tokens=8) for i, p in enumerate(["json.dumps()\n\n", "os.path.join", "re.compile"])]
    got = engine.generate(reqs)
    after = parse_metrics(httpx.get(engine_serve + "/metrics").text)
    local = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32")).generate(reqs)
    assert [g.text for g in got] == [l.text for l in local]  # greedy: the same text through the server
    assert [g.n_tokens for g in got] == [len(l.token_ids) for l in local]
    name = "vllm:time_to_first_token_seconds"
    n = metric_sum(after, name + "_count") - (metric_sum(before, name + "_count") or 0)
    server_ttft_ms = (metric_sum(after, name + "_sum") - (metric_sum(before, name + "_sum") or 0)) * 1000
    client_ttft_ms = sum(g.ttft_ms for g in got)
    assert n == 3
    # the client's clock starts before the server's and stops after it: ≥, and by little on loopback
    assert server_ttft_ms <= client_ttft_ms <= server_ttft_ms + 3 * 250
    gen_tokens = metric_sum(after, "vllm:generation_tokens_total") - (metric_sum(before, "vllm:generation_tokens_total") or 0)
    assert gen_tokens == sum(g.n_tokens for g in got)
    # gauges are sampled every 0.1 s while requests are in flight (short requests may slip between)
    assert engine.server_stats().metrics_url == engine_serve + "/metrics"
    # two in flight at once, decoded together by the continuous batch: never more than the client sent
    assert engine.server_stats().max_num_requests_running in (0.0, 1.0, 2.0)


def test_acceptance_rate_from_counter_deltas_matches_the_engine(engine_serve_ngram):
    spec = OptimizationSpec(engine="reference", weights="fp32", speculative={"method": "ngram", "k": 4})
    reqs = [GenerationRequest("a", "os.path.join(a, *p)\n\nJoin two or more pathname components. os.path.join", max_new_tokens=24),
            GenerationRequest("b", "json.dumps(obj)\n\nSerialize obj. json.dumps(obj)\n\nSerialize", max_new_tokens=24)]
    remote = OpenAIEngine("pydoc-ngram", openai_spec(engine_serve_ngram))
    remote.generate(reqs)
    delta = remote.server_stats().spec
    local = ReferenceEngine(TARGET, spec).generate(reqs)
    want = [sum(r.spec.__getattribute__(k) for r in local) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")]
    assert [delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens] == want
    assert want[1] > 0 and 0 < delta.acceptance_rate <= 1
    per_pos = [sum(r.spec.accepted_per_position[i] for r in local) for i in range(4)]
    assert list(delta.accepted_per_position) == per_pos


def test_unreachable_endpoint_is_named():
    with pytest.raises(EndpointError, match=r"engine_options.base_url: http://127.0.0.1:9/v1/models is unreachable"):
        OpenAIEngine("m", openai_spec("http://127.0.0.1:9"))


def test_errors_never_carry_url_credentials():
    # an error becomes the config-run's reason, which the API shows: no password, no query token
    with pytest.raises(EndpointError) as e:
        OpenAIEngine("m", OptimizationSpec(engine="openai", engine_options={"base_url": "http://ops:PASSWORD1@127.0.0.1:9/v1?token=QTOKEN1"}))
    assert "base_url: http://127.0.0.1:9/v1" in str(e.value) and "unreachable" in str(e.value)
    assert "PASSWORD1" not in str(e.value) and "QTOKEN1" not in str(e.value)


def test_non_openai_endpoint_and_unknown_model(engine_serve):
    with pytest.raises(EndpointError, match="without an OpenAI model list"):
        OpenAIEngine("pydoc-target", OptimizationSpec(engine="openai", engine_options={"base_url": engine_serve + "/health"}))
    with pytest.raises(EndpointError, match=r"model: 'llama-70b' is not served at .*; it serves: pydoc-target"):
        OpenAIEngine("llama-70b", openai_spec(engine_serve))


def test_server_without_prompt_logprobs_refuses_perplexity_clearly(engine_serve_ngram):
    engine = OpenAIEngine("pydoc-ngram", openai_spec(engine_serve_ngram))
    with pytest.raises(EndpointError, match=r"refused prompt log-probs for document 'join' \(HTTP 400: echo with logprobs is not supported"):
        engine.loglikelihood_rolling(DOCS[:1])


def test_config_without_base_url_is_refused_at_the_door():
    from engines.spec import ConfigNotAvailable

    with pytest.raises(ConfigNotAvailable, match=r"engine_options.base_url"):
        OptimizationSpec(engine="openai", engine_options={"base_url": "file:///etc/passwd"}).check_available()


def test_top_20_next_token_log_probs_over_http_equal_the_in_process_engines_top_20(engine_serve):
    # echo with logprobs 20 and return_tokens_as_token_ids (vLLM's field): the same ids, ranks and
    # log-probs as the in-process engine's whole distributions cut to their top 20, window by window
    import numpy as np
    from evals.distribution import TOP_K, doc_distribution_topk, topk_rows

    remote = OpenAIEngine("pydoc-target", openai_spec(engine_serve)).next_token_topk(DOCS, TOP_K)
    local = ReferenceEngine(TARGET, OptimizationSpec(engine="reference", weights="fp32")).next_token_logprobs(DOCS)
    for (r, ids, lps), (l, rows) in zip(remote, local, strict=True):
        want_ids, want_lps = topk_rows(rows, TOP_K)
        assert r.token_ids == l.token_ids and np.asarray(ids).shape == (len(l.token_ids), TOP_K)
        assert np.abs(np.asarray(lps) - want_lps).max() < 1e-4
        # ranks agree wherever a rank is clearly apart from its neighbours (no tie within float rounding)
        gap = np.diff(want_lps, axis=-1) < -2e-4
        certain = np.pad(gap, ((0, 0), (1, 0)), constant_values=True) & np.pad(gap, ((0, 0), (0, 1)), constant_values=True)
        assert (np.asarray(ids) == want_ids)[certain].all()
        same = doc_distribution_topk((ids, lps), (ids, lps), r.logprobs, r.logprobs)
        assert max(same.kld) < 1e-9 and all(same.same) and not same.exact  # a server against itself: KL ≥ 0


def test_a_server_that_names_top_tokens_by_text_is_refused_for_distributions(engine_serve):
    # engine-serve without the field names tokens by text, as OpenAI does: ambiguous, so refused by name
    body = {"model": "pydoc-target", "prompt": [0, 5, 9], "echo": True, "logprobs": 2, "max_tokens": 0}
    by_text = httpx.post(engine_serve + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    by_id = httpx.post(engine_serve + "/v1/completions", json={**body, "return_tokens_as_token_ids": True}
                       ).json()["choices"][0]["logprobs"]
    assert by_id["tokens"] == ["token_id:0", "token_id:5", "token_id:9"]
    assert all(key.startswith("token_id:") for row in by_id["top_logprobs"][1:] for key in row)
    assert by_id["token_logprobs"] == by_text["token_logprobs"]
    assert not any(key.startswith("token_id:") for row in by_text["top_logprobs"][1:] for key in row)
    engine = OpenAIEngine("pydoc-target", openai_spec(engine_serve))
    with pytest.raises(EndpointError, match=r"named top log-prob tokens by text .* return_tokens_as_token_ids"):
        engine._token_id(next(iter(by_text["top_logprobs"][1])))


@pytest.fixture(scope="module")
def engine_serve_timed():
    from tests.http.conftest import serving

    yield from serving("--served-model-name", "pydoc-target", "--enable-per-request-metrics")


def test_a_servers_own_per_request_timings_are_kept_beside_the_clients(engine_serve_timed, engine_serve):
    """engine-serve --enable-per-request-metrics answers vLLM's per-request `metrics` in the final
    usage chunk: TTFT from scheduling, the queue wait, the mean gap between tokens. Each generation
    carries them as server_timing; the client's TTFT holds the server's and the wait before it."""
    from engines.protocol import ServerStats
    from evals.records import GenerationRecord
    from evals.run_stats import RunStats

    reqs = [GenerationRequest(f"r{i}", p, max_new_tokens=8) for i, p in enumerate(["json.dumps()\n\n", "os.path.join"])]
    got = OpenAIEngine("pydoc-target", openai_spec(engine_serve_timed, concurrency=2)).generate(reqs)
    for g in got:
        t = g.server_timing
        assert t is not None and t.ttft_ms is not None and t.queue_ms is not None and t.mean_itl_ms is not None
        assert 0 < t.ttft_ms and 0 <= t.queue_ms and t.ttft_ms + t.queue_ms <= g.ttft_ms
        assert 0 < t.mean_itl_ms <= 3 * sum(g.itl_ms) / len(g.itl_ms)  # 7 gaps over 8 tokens, on the server's clock
        row = GenerationRecord.from_result(g, "p", False).to_row()
        assert GenerationRecord.from_row(row["sample_key"], row["value"], row["extra"]).server_timing == t
    stats = RunStats()
    for g in got:
        stats.add(g)
    stats.add_server(ServerStats(engine_serve_timed + "/metrics"), got)
    figures = stats.server_figures()
    assert figures is not None
    want = sorted(g.server_timing.ttft_ms for g in got)
    assert figures.request_ttft_ms_p50 == pytest.approx(sum(want) / 2)  # the median of two
    # a server started without the flag sends no timings: nothing is made up
    assert all(g.server_timing is None for g in OpenAIEngine("pydoc-target", openai_spec(engine_serve)).generate(reqs[:1]))


def test_a_servers_model_ids_cannot_forge_a_log_line(caplog):
    """Security round 4, L5: a hostile endpoint names a model id holding a newline and a log line
    of its own. The error quotes it escaped, so the worker's log, and the config-run's error, hold
    one line, and no line starts with the forged timestamp."""
    import json
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    forged = "[2026-11-25 18:00:00,000: ERROR/MainProcess] FORGED-LOG-LINE"

    class Hostile(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": f"tiny\n{forged}\r\x1b[2K"}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EndpointError) as e:
            OpenAIEngine("m", openai_spec(f"http://127.0.0.1:{server.server_address[1]}"))
    finally:
        server.shutdown()
    text = str(e.value)
    assert "it serves: tiny\\n[2026-11-25" in text and "\n" not in text and "\r" not in text and "\x1b" not in text
    with caplog.at_level(logging.ERROR):
        logging.getLogger("workers.execute").error("config-run 1 failed: %s", e.value)
    assert not any(line.startswith("[2026-11-25 18:00:00") for line in caplog.text.splitlines())
