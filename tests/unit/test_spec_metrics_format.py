"""vLLM's per-request speculative-decoding summary (PR #48915), both ways, worked by hand on the
PR's own example: histogram [39, 1, 0, 3] over k = 3 is 43 steps, 1·1 + 3·3 = 10 tokens accepted;
position 0 was accepted by the 1 + 0 + 3 = 4 steps that accepted at least one draft, position 1
by 0 + 3 = 3, position 2 by 3."""

from engines.protocol import SpecStats
from engines.server_metrics import spec_from_response
from workers.engine_server.answers import spec_decode_metrics

EXAMPLE = {"mean_acceptance_length": 1.2325581395348837, "draft_acceptance_rate": 0.07751937984496124,
           "acceptance_histogram": [39, 1, 0, 3], "num_spec_steps": 43, "num_accepted_draft_tokens": 10,
           "num_draft_tokens": 129, "num_spec_tokens": 3}


def test_the_summary_read_into_counters():
    stats = spec_from_response({"choices": [], "metrics": {"speculative_decoding": EXAMPLE}})
    assert stats == SpecStats(43, 129, 10, (4, 3, 3))
    assert stats.acceptance_rate == 10 / 129 and stats.mean_acceptance_length == 1 + 10 / 43


def test_counters_written_as_the_summary():
    assert spec_decode_metrics(SpecStats(43, 129, 10, (4, 3, 3))) == EXAMPLE


def test_no_summary_or_one_that_is_not_numbers_is_none():
    assert spec_from_response({"choices": []}) is None
    assert spec_from_response({"metrics": {"speculative_decoding": {"num_spec_steps": "many"}}}) is None
    assert spec_from_response({"metrics": {"speculative_decoding": {**EXAMPLE, "acceptance_histogram": ["x"]}}}) is None
    assert spec_from_response({"metrics": "n/a"}) is None
