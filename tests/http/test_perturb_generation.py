"""The perturbing proxy's seeded generation behaviours (tests/http/perturb.py) against a real
`canary engine-serve`, read through the `openai` SDK as a client of a served model reads them:
each behaviour's truth is known (which requests it changed, and where a flip happened), so that
what the canary says about such a server can be checked against it."""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.http.perturb import (
    UNRELATED_PROMPTS,
    Loops,
    NearTieFlips,
    PhraseLoops,
    Truncation,
    UnrelatedText,
    WhenBatched,
    confident_flips,
    corrupt_when_batched,
    empty_answers,
    loops,
    near_tie_flips,
    proxy_app,
    truncation,
)
from tests.loopback import free_port, serve_in_thread

MODEL = "pydoc-target"  # tests/http/conftest.py's engine_serve
MAX_TOKENS = 16
PROMPTS = ["def read_file(path):", "class Parser:", "The os module", "import json", "Return the number of",
           "The default value is", "This function returns", "Raise a ValueError if", "The socket module provides",
           "A list of strings", "If the file does not exist,", "The following example shows", "Open a connection to",
           "The argument must be", "Changed in version 3.", "The result is a tuple"]


@dataclass(frozen=True)
class Streamed:
    pieces: tuple[str, ...]  # the text of each streamed event
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def ask(base: str, prompt: str, max_tokens: int = MAX_TOKENS) -> Streamed:
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            if choice.text:
                pieces.append(choice.text)
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return Streamed(tuple(pieces), finish, usage.prompt_tokens, usage.completion_tokens)


@contextlib.contextmanager
def serving(app):
    port = free_port()
    server = serve_in_thread(app, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True


def all_at_once(base: str, prompts: list[str]) -> dict[str, Streamed]:
    """Each prompt asked from its own thread, all released together: every request in flight at once."""
    start = threading.Barrier(len(prompts))

    def together(prompt: str) -> Streamed:
        start.wait()
        return ask(base, prompt)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return dict(zip(prompts, pool.map(together, prompts), strict=True))


@pytest.fixture(scope="module")
def greedy(engine_serve) -> dict[str, Streamed]:
    """The upstream's own greedy answer to each prompt, streamed to the client directly."""
    return {prompt: ask(engine_serve, prompt) for prompt in PROMPTS}


def gaps(engine_serve: str, prompt: str) -> list[float]:
    """Top-1 minus top-2 log-prob at each position of the greedy answer, from the upstream itself."""
    answer = httpx.post(engine_serve + "/v1/completions", timeout=60,
                        json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                              "logprobs": 2}).json()
    out = []
    for top in answer["choices"][0]["logprobs"]["top_logprobs"]:
        first, second = sorted(top.values(), reverse=True)[:2]
        out.append(first - second)
    return out


def test_at_rate_0_every_behaviour_answers_the_upstreams_own_greedy_answer(engine_serve, greedy):
    behaviours = [near_tie_flips(0.0, seed=1), confident_flips(0.0, seed=1), empty_answers(0.0, seed=1),
                  loops(0.0, seed=1), truncation(0.0, seed=1), corrupt_when_batched(seed=1)]  # the last: one at a time
    for index, behaviour in enumerate(behaviours):
        with serving(proxy_app(engine_serve, generation=behaviour)) as proxy:
            for prompt in PROMPTS[index * 2: index * 2 + 4]:
                assert ask(proxy, prompt) == greedy[prompt], (behaviour.name, prompt)
        assert behaviour.affected == [], behaviour.name


def _flipped(engine_serve, greedy, behaviour, prompts) -> list:
    with serving(proxy_app(engine_serve, generation=behaviour)) as proxy:
        answers = {prompt: ask(proxy, prompt) for prompt in prompts}
    assert sorted(behaviour.affected) == sorted(prompts)
    assert [r.prompt for r in behaviour.records] == prompts
    for record in behaviour.records:
        got, plain, i = answers[record.prompt], greedy[record.prompt], record.position
        assert got.text != plain.text, record
        # the first difference is the flipped token, the other of the upstream's top two there
        assert got.pieces[:i] == plain.pieces[:i] and got.pieces[i] == record.replacement != plain.pieces[i], record
        assert got.prompt_tokens == plain.prompt_tokens and got.completion_tokens <= MAX_TOKENS
        if got.completion_tokens == MAX_TOKENS:
            assert got.finish_reason == "length"
        upstream_gaps = gaps(engine_serve, record.prompt)
        assert list(record.gaps) == pytest.approx(upstream_gaps, abs=1e-6)
    return behaviour.records


def test_near_tie_flips_flip_every_answer_at_its_smallest_top2_gap(engine_serve, greedy):
    prompts = PROMPTS[:8]
    records = _flipped(engine_serve, greedy, near_tie_flips(1.0, seed=3), prompts)
    for record in records:
        scored = [g for g in record.gaps if g is not None]
        assert record.gap == pytest.approx(min(scored)) and record.gaps.index(min(scored)) == record.position
    near = [r.gap for r in records]
    print(f"near-tie gaps (nats): median {statistics.median(near):.3f}, range {min(near):.3f} to {max(near):.3f}")
    assert statistics.median(near) < 0.2 and max(near) < 0.5  # near-ties: the top two nearly equally likely


def test_confident_flips_flip_every_answer_at_its_largest_top2_gap(engine_serve, greedy):
    prompts = PROMPTS[8:]
    records = _flipped(engine_serve, greedy, confident_flips(1.0, seed=3), prompts)
    for record in records:
        scored = [g for g in record.gaps if g is not None]
        assert record.gap == pytest.approx(max(scored)) and record.gaps.index(max(scored)) == record.position
    sure = [r.gap for r in records]
    print(f"confident gaps (nats): median {statistics.median(sure):.3f}, range {min(sure):.3f} to {max(sure):.3f}")
    assert min(sure) > 1.0  # a token the model was sure of: never a nondeterministic near-tie


def test_the_same_seed_gives_the_same_answers_whatever_the_arrival_order(engine_serve, greedy):
    first, second, other = near_tie_flips(0.5, seed=7), near_tie_flips(0.5, seed=7), near_tie_flips(0.5, seed=8)
    with serving(proxy_app(engine_serve, generation=first)) as proxy:
        one = {prompt: ask(proxy, prompt) for prompt in PROMPTS}
    with serving(proxy_app(engine_serve, generation=second)) as proxy, ThreadPoolExecutor(4) as pool:
        backwards = PROMPTS[::-1]  # another order, four at a time
        two = dict(zip(backwards, pool.map(lambda prompt: ask(proxy, prompt), backwards), strict=True))
    assert one == two
    assert sorted(first.affected) == sorted(second.affected)
    assert 0 < len(first.affected) < len(PROMPTS), first.affected  # some, not all
    print(f"rate 0.5, seed 7: {len(first.affected)} of {len(PROMPTS)} answers flipped")
    for prompt in PROMPTS:
        assert (one[prompt] != greedy[prompt]) == (prompt in first.affected), prompt
    assert {p for p in PROMPTS if other.hits(p)} != set(first.affected)  # another seed, other requests


def test_empty_loop_and_truncated_answers_have_their_shapes(engine_serve, greedy):
    prompts = PROMPTS[:3]
    with serving(proxy_app(engine_serve, generation=empty_answers(1.0))) as proxy:
        for prompt in prompts:
            got = ask(proxy, prompt)
            assert got == Streamed((), "stop", greedy[prompt].prompt_tokens, 0), got
    with serving(proxy_app(engine_serve, generation=loops(1.0))) as proxy:
        for prompt in prompts:
            got, plain = ask(proxy, prompt), greedy[prompt]
            assert got == Streamed((plain.pieces[0],) * MAX_TOKENS, "length", plain.prompt_tokens, MAX_TOKENS), got
    with serving(proxy_app(engine_serve, generation=truncation(1.0))) as proxy:
        for prompt in prompts:
            got, plain = ask(proxy, prompt), greedy[prompt]
            keep = max(1, plain.completion_tokens // 4)
            assert got == Streamed(plain.pieces[:keep], "stop", plain.prompt_tokens, keep), got


def test_corrupt_when_batched_leaves_lone_requests_alone_and_corrupts_concurrent_ones(engine_serve, greedy):
    prompts = PROMPTS[:8]
    behaviour = corrupt_when_batched(seed=5)
    with serving(proxy_app(engine_serve, generation=behaviour)) as proxy:
        alone = {prompt: ask(proxy, prompt) for prompt in prompts}
        assert alone == {prompt: greedy[prompt] for prompt in prompts} and behaviour.affected == []
        batched = all_at_once(proxy, prompts)
    changed = [prompt for prompt in prompts if batched[prompt].text != greedy[prompt].text]
    assert sorted(changed) == sorted(behaviour.affected)  # every corrupted answer differs from its own
    assert len(changed) >= 6, changed  # mostly: all eight are in flight together
    print(f"corrupted when batched: {len(changed)} of {len(prompts)}; crosstalk partners {behaviour.records}")
    partners = dict(behaviour.records)
    for prompt in changed:
        if partners[prompt] is not None:  # crosstalk: another row's answer
            assert partners[prompt] != prompt and batched[prompt].text == greedy[partners[prompt]].text
        assert batched[prompt].prompt_tokens == greedy[prompt].prompt_tokens


def test_a_sampled_completion_is_relayed_untouched(engine_serve):
    behaviour = near_tie_flips(1.0)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 11, "stream": True}

    def text(base: str) -> str:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            return "".join(json.loads(line[6:])["choices"][0]["text"] for line in response.iter_lines()
                           if line.startswith("data: {") and json.loads(line[6:])["choices"])

    with serving(proxy_app(engine_serve, generation=behaviour)) as proxy:
        assert text(proxy) == text(engine_serve) and behaviour.affected == []  # only greedy requests are changed


def test_loops_phrase_loops_and_truncation_start_where_they_are_told(engine_serve, greedy):
    prompts = PROMPTS[3:6]
    with serving(proxy_app(engine_serve, generation=Loops(1.0, after=5))) as proxy:
        for prompt in prompts:
            got, plain = ask(proxy, prompt), greedy[prompt]
            assert got.pieces[:5] == plain.pieces[:5] and set(got.pieces[5:]) == {plain.pieces[5]}, got
            assert got.completion_tokens == MAX_TOKENS and got.finish_reason == "length"
    with serving(proxy_app(engine_serve, generation=PhraseLoops(1.0, n=3, after=6))) as proxy:
        for prompt in prompts:
            got, plain = ask(proxy, prompt), greedy[prompt]
            phrase = plain.pieces[3:6]
            expected = (list(plain.pieces[:6]) + list(phrase) * MAX_TOKENS)[:MAX_TOKENS]
            assert list(got.pieces) == [p for p in expected if p], got  # the proxy streams no empty piece
            assert got.completion_tokens == MAX_TOKENS and got.finish_reason == "length"
    with serving(proxy_app(engine_serve, generation=Truncation(1.0, keep=0.75))) as proxy:
        for prompt in prompts:
            got, plain = ask(proxy, prompt), greedy[prompt]
            keep = int(plain.completion_tokens * 0.75)
            assert got == Streamed(plain.pieces[:keep], "stop", plain.prompt_tokens, keep), got
    with pytest.raises(ValueError, match="keep"):
        Truncation(0.5, keep=1.0)
    with pytest.raises(ValueError, match="n must be"):
        PhraseLoops(0.5, n=0)


def test_unrelated_text_answers_another_prompt(engine_serve, greedy):
    behaviour = UnrelatedText(1.0, seed=2)
    with serving(proxy_app(engine_serve, generation=behaviour)) as proxy:
        got = {prompt: ask(proxy, prompt) for prompt in PROMPTS[:4]}
        others = {ask(engine_serve, other).text for other in UNRELATED_PROMPTS}
    for prompt, answer in got.items():
        assert answer.text in others and answer.text != greedy[prompt].text, prompt
        assert answer.prompt_tokens == greedy[prompt].prompt_tokens  # still the asked prompt's usage
    assert sorted(behaviour.affected) == sorted(PROMPTS[:4]) and behaviour.share() == 1.0


def test_near_tie_flips_never_flip_a_gap_wider_than_max_gap(engine_serve, greedy):
    behaviour = NearTieFlips(1.0, seed=4, max_gap=0.1)
    with serving(proxy_app(engine_serve, generation=behaviour)) as proxy:
        got = {prompt: ask(proxy, prompt) for prompt in PROMPTS}
    nearest = {prompt: min(gaps(engine_serve, prompt)) for prompt in PROMPTS}
    assert all(record.gap <= 0.1 for record in behaviour.records)
    for prompt in PROMPTS:  # a prompt whose nearest tie is wider than 0.1 nats keeps its greedy answer
        assert (got[prompt] != greedy[prompt]) == (prompt in behaviour.affected), prompt
        if nearest[prompt] > 0.1 + 1e-6:
            assert got[prompt] == greedy[prompt], (prompt, nearest[prompt])
    wide = [p for p in PROMPTS if nearest[p] > 0.1 + 1e-6]
    print(f"max_gap 0.1: {len(behaviour.affected)} of {len(PROMPTS)} flipped; {len(wide)} had no tie that near")
    assert behaviour.affected and wide  # both kinds among these prompts: the bound is what decided


def test_a_fault_when_batched_leaves_lone_requests_alone(engine_serve, greedy):
    prompts = PROMPTS[8:14]
    behaviour = WhenBatched(empty_answers(1.0, seed=6))
    with serving(proxy_app(engine_serve, generation=behaviour)) as proxy:
        alone = {prompt: ask(proxy, prompt) for prompt in prompts}
        assert alone == {prompt: greedy[prompt] for prompt in prompts} and behaviour.affected == []
        batched = all_at_once(proxy, prompts)
    emptied = [prompt for prompt in prompts if batched[prompt].text == ""]
    assert sorted(emptied) == sorted(behaviour.affected) and len(emptied) >= len(prompts) - 1, emptied
    assert behaviour.name == "empty_answers_when_batched"
    assert behaviour.length_ratio() is not None and behaviour.length_ratio() < 0.5
