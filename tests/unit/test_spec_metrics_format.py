"""vLLM's per-request speculative-decoding summary (PR #48915), both ways, worked by hand on the
PR's own example: histogram [39, 1, 0, 3] over k = 3 is 43 steps, 1·1 + 3·3 = 10 tokens accepted;
position 0 was accepted by the 1 + 0 + 3 = 4 steps that accepted at least one draft, position 1
by 0 + 3 = 3, position 2 by 3."""

from engines.protocol import SpeculativeStats
from engines.server_metrics import spec_from_response
from workers.engine_server.answers import spec_decode_metrics

EXAMPLE = {"mean_acceptance_length": 1.2325581395348837, "draft_acceptance_rate": 0.07751937984496124,
           "acceptance_histogram": [39, 1, 0, 3], "num_spec_steps": 43, "num_accepted_draft_tokens": 10,
           "num_draft_tokens": 129, "num_spec_tokens": 3}


def test_the_summary_read_into_counters():
    stats = spec_from_response({"choices": [], "metrics": {"speculative_decoding": EXAMPLE}})
    assert stats == SpeculativeStats(43, 129, 10, (4, 3, 3))
    assert stats.acceptance_rate == 10 / 129 and stats.mean_acceptance_length == 1 + 10 / 43


def test_counters_written_as_the_summary():
    assert spec_decode_metrics(SpeculativeStats(43, 129, 10, (4, 3, 3))) == EXAMPLE


def test_no_summary_or_one_that_is_not_numbers_is_none():
    assert spec_from_response({"choices": []}) is None
    assert spec_from_response({"metrics": {"speculative_decoding": {"num_spec_steps": "many"}}}) is None
    assert spec_from_response({"metrics": {"speculative_decoding": {**EXAMPLE, "acceptance_histogram": ["x"]}}}) is None
    assert spec_from_response({"metrics": "n/a"}) is None


def test_parsing_only_the_gauges_a_sampler_needs_keeps_them_and_drops_the_rest():
    """A scrape while requests stream parses only the metrics asked for: their samples come back
    as a whole parse gives them, and a histogram's lines are not parsed at all."""
    from engines.server_metrics import parse_metrics

    text = "\n".join([
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="pydoc"} 0.25',
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="pydoc"} 3.0',
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="pydoc"} 1.0',
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="pydoc"} 2.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="pydoc"} 2.0',
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="pydoc"} 0.3', ""])
    whole = parse_metrics(text)
    gauges = parse_metrics(text, ("vllm:kv_cache_usage_perc", "vllm:num_requests_running"))
    assert gauges == {k: v for k, v in whole.items() if not k[0].startswith("vllm:time_to_first_token")}
    assert len(gauges) == 2 and len(whole) == 6
    assert parse_metrics(text, ()) == {}
