"""The judge client and scorers against a scripted OpenAI-compatible judge on loopback (real
HTTP; the verdicts are scripted — a hosted judge cannot run here — so every figure is known)."""

from __future__ import annotations

import math

import pytest
from evals.faithfulness import JudgeFaithfulness, MissingContexts, mean_faithfulness
from evals.judge import JudgeClient, JudgeConfig, JudgeError, pairwise, rubric, summarize_pairwise

Q = "What does os.path.join do?"
GOOD = "RIGHT: it joins path components with the separator."
BAD = "It deletes the file."


def client(judge, **kw) -> JudgeClient:
    return JudgeClient(JudgeConfig(base_url=judge.base_url, model="judge", backoff_s=0.05, **kw))


def test_pairwise_judges_both_orders_and_counts_a_win_only_when_they_agree(judge_server):
    with client(judge_server) as c:
        v = pairwise(c, "s1", Q, baseline=BAD, candidate=GOOD)
    assert (v.winner, v.consistent, v.orders) == ("candidate", True, ("candidate", "candidate"))
    prompts = [body["messages"][0]["content"] for _, body in judge_server.requests]
    assert len(prompts) == 2  # both orders were asked: the baseline first, then the candidate first
    assert prompts[0].index(BAD) < prompts[0].index(GOOD) and prompts[1].index(GOOD) < prompts[1].index(BAD)


def test_position_bias_becomes_a_tie_and_lowers_consistency(judge_server):
    judge_server.bias_a = True  # always prefers answer A
    with client(judge_server) as c:
        verdicts = [pairwise(c, f"s{i}", Q + str(i), BAD, GOOD) for i in range(4)]
    assert {v.winner for v in verdicts} == {"tie"} and not any(v.consistent for v in verdicts)
    s = summarize_pairwise(verdicts)
    assert (s.n, s.ties, s.position_consistency, s.candidate_win_rate) == (4, 4, 0.0, 0.5)


def test_malformed_output_is_retried_then_counted_never_scored(judge_server):
    judge_server.script = [{"content": "The winner is clearly B."}]  # prose, then the rule's JSON
    with client(judge_server) as c:
        v = pairwise(c, "s1", Q, BAD, GOOD)
        assert v.winner == "candidate" and v.parse_failures == 1
        judge_server.script = [{"content": "no json"}, {"content": '{"winner": "C"}'}, {"content": "{broken"}]
        v2 = pairwise(c, "s2", Q + "?", BAD, GOOD)
    assert v2.winner == "parse_failure" and v2.parse_failures == 3
    s = summarize_pairwise([v, v2])
    assert (s.n, s.parse_failures, s.candidate_wins) == (1, 1, 1)  # surfaced, and not a loss or a 0


def test_rubric_probability_weighted_score_by_hand(judge_server):
    # score token "5" with alternatives 5: 0.7, 4: 0.2, 3: 0.095, 2: 0.005 (< 1 %, dropped):
    # (5·0.7 + 4·0.2 + 3·0.095) / 0.995 = 4.5578
    top = [["5", math.log(0.7)], ["4", math.log(0.2)], ["3", math.log(0.095)], ["2", math.log(0.005)]]
    judge_server.script = [{"content": '{"score": 5, "reason": "ok"}', "top_logprobs": top}]
    with client(judge_server) as c:
        r = rubric(c, "s1", Q, GOOD, reference="It joins paths.")
    assert r.weighted and r.stated == 5
    assert r.score == pytest.approx((5 * 0.7 + 4 * 0.2 + 3 * 0.095) / 0.995)
    assert "reference answer" in judge_server.requests[0][1]["messages"][0]["content"]


def test_rubric_without_logprobs_uses_the_stated_score_and_caches(judge_server):
    with client(judge_server) as c:
        a = rubric(c, "s1", Q, BAD)
        b = rubric(c, "s1", Q, BAD)
        assert (a.score, a.weighted, b.score) == (2.0, False, 2.0)
        assert len(judge_server.requests) == 1 and c.usage.cached == 1  # the second came from the cache
        assert c.usage.requests == 1 and c.usage.prompt_tokens > 0 and c.usage.completion_tokens == 4


def test_429_honours_retry_after(judge_server):
    judge_server.script = [{"status": 429, "retry_after": "1"}]
    with client(judge_server) as c:
        assert rubric(c, "s", Q, GOOD).score == 5.0
        assert c.usage.http_retries == 1
    (t0, _), (t1, _) = judge_server.requests
    assert t1 - t0 >= 1.0  # waited as told, not the 0.05 s backoff


def test_5xx_and_timeouts_are_retried_with_backoff(judge_server):
    judge_server.script = [{"status": 500}, {"status": 503}, {"sleep": 1.5}]
    with client(judge_server, timeout_s=0.5) as c:
        assert rubric(c, "s", Q, GOOD).score == 5.0
        assert c.usage.http_retries == 3
    assert len(judge_server.requests) == 4


def test_other_4xx_fail_at_once_naming_the_endpoint(judge_server):
    judge_server.script = [{"status": 400}]
    with client(judge_server) as c, pytest.raises(JudgeError, match=r"judge http://127.0.0.1:\d+/v1/chat/completions refused .*HTTP 400.*not retried"):
        rubric(c, "s", Q, GOOD)
    assert len(judge_server.requests) == 1


def test_retries_are_capped(judge_server):
    judge_server.script = [{"status": 500}] * 10
    with client(judge_server, max_http_retries=2) as c, pytest.raises(JudgeError, match="failed after 3 attempts: HTTP 500"):
        rubric(c, "s", Q, GOOD)


def test_rate_limit_spaces_requests(judge_server):
    with client(judge_server, requests_per_second=5, concurrency=4) as c:
        c.map(lambda i: rubric(c, f"s{i}", Q + str(i), GOOD), range(4))
    times = sorted(t for t, _ in judge_server.requests)
    assert times[-1] - times[0] >= 3 * 0.2 - 0.05  # 4 starts at ≥ 0.2 s apart


def test_faithfulness_through_the_judge(judge_server):
    ctx = ["os.path.join joins path components. It inserts the separator."]
    with client(judge_server) as c:
        f = JudgeFaithfulness(c)
        half = f.score("s1", "os.path.join joins path components. It deletes files.", ctx, Q)
        empty = f.score("s2", "", ctx, Q)
        with pytest.raises(MissingContexts, match="sample 's3': a RAG item needs at least one non-empty context"):
            f.score("s3", "anything", [], Q)
    assert (half.outcome, half.score) == ("scored", 0.5)
    assert [ok for _, ok in half.statements] == [True, False]
    assert (empty.outcome, empty.score) == ("no_statements", None)
    summary = mean_faithfulness([half, empty])
    assert summary == {"mean": 0.5, "n_scored": 1, "no_statements": 1, "parse_failures": 0, "method": half.method}
