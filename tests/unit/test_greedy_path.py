"""An answer read back by the baseline model on a real engine (workers/generation.BaselineScorer):
where it leaves the model's greedy path (evals/health.leaves_greedy). The model's own greedy
answers never do, on either in-process engine, though tokenizing them again merges some of their
tokens; an answer flipped at a confident token does, by the gap between its top two tokens."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from engines.protocol import GenerationRequest, WindowSpec
from engines.registry import load_engine
from engines.spec import OptimizationSpec
from engines.zoo import ARTIFACTS, resolve_model_path
from evals.health import NEAR_TIE_NATS
from workers.generation import BaselineScorer

pytestmark = pytest.mark.integration  # both engines' greedy answers scored whole: about 18 s

TARGET = str(resolve_model_path("builtin:pydoc-target"))
WINDOW = WindowSpec(max_length=256, stride=256)


def prompts(n: int) -> list[GenerationRequest]:
    with open(ARTIFACTS / "pydoc-heldout.jsonl") as f:
        docs = [json.loads(line) for line in f][:n]
    return [GenerationRequest(f"p{i}", " ".join(d["text"].split()[:12]), 16, 0.0) for i, d in enumerate(docs)]


@pytest.mark.parametrize("engine", ["reference", "transformers"])
def test_the_models_own_greedy_answers_stay_on_its_greedy_path(engine):
    model = load_engine(TARGET, OptimizationSpec(engine=engine))
    requests = prompts(32)
    answers = model.generate(requests)
    read = BaselineScorer(model).score(answers, {r.request_id: r.prompt for r in requests}, WINDOW)
    scored = [s for _, _, s in read]
    assert all(s is not None and s.greedy_known for s in scored)
    # some answers read back in other tokens than generated (the check stops there), none leaves by > τ
    assert [s.leaves_after(0, NEAR_TIE_NATS) for s in scored if s is not None] == [None] * len(scored)


def test_an_answer_that_merges_with_its_prompt_or_runs_past_the_window_is_not_read_there():
    """A prompt that ends mid-word: the answer's first token merges with the prompt's last when
    read back, so the answer is not checked (greedy_known False). A window shorter than prompt +
    answer: tokens past it are read with less context than generated, so they are not checked."""
    model = load_engine(TARGET, OptimizationSpec(engine="reference"))
    [answer] = model.generate([GenerationRequest("m", "the compiler exp", 8, 0.0)])
    merged = 0
    for prompt, text in (("the compiler exp", "oled"), ("the function", "s"), ("return the value 1", "0.5")):
        ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if model.tokenizer(prompt + text, add_special_tokens=False)["input_ids"][: len(ids)] == ids:
            continue  # no merge in this tokenizer
        merged += 1
        [(_, _, read)] = BaselineScorer(model).score([replace(answer, text=text)], {"m": prompt}, WINDOW)
        assert not read.greedy_known and read.leaves == ()
    assert merged
    requests = prompts(8)
    answers = model.generate(requests)
    short = WindowSpec(max_length=24, stride=24)
    read = BaselineScorer(model).score(answers, {r.request_id: r.prompt for r in requests}, short)
    assert [s.leaves_after(0, NEAR_TIE_NATS) for _, _, s in read] == [None] * len(read)


def test_an_answer_flipped_at_a_confident_token_leaves_the_greedy_path_there():
    model = load_engine(TARGET, OptimizationSpec(engine="reference"))
    tokenizer = model.tokenizer
    for request in prompts(8):
        [greedy] = model.generate([request])
        prompt_ids = [model.start_id, *tokenizer(request.prompt, add_special_tokens=False)["input_ids"]]
        scores = model.prompt_logprobs([*prompt_ids, *greedy.token_ids], top_k=2)
        # the answer's most confident token (the largest gap between its top two), as a buggy server flips it
        at = len(prompt_ids) - 1
        gaps = [(row[0][1] - row[1][1], i) for i, row in enumerate(scores.top[at : at + len(greedy.token_ids)])]
        gap, position = max(gaps)
        runner_up = scores.top[at + position][1][0]
        before = tokenizer.decode(greedy.token_ids[:position], clean_up_tokenization_spaces=False)
        flipped = before + tokenizer.decode([runner_up], clean_up_tokenization_spaces=False)
        if tokenizer(request.prompt + flipped, add_special_tokens=False)["input_ids"] != [
                *prompt_ids[1:], *greedy.token_ids[:position], runner_up]:
            continue  # the flipped text reads back in other tokens: not this test's case
        answer = replace(greedy, text=flipped, token_ids=(*greedy.token_ids[:position], runner_up))
        [(_, _, scored)] = BaselineScorer(model).score([answer], {request.request_id: request.prompt}, WINDOW)
        assert scored.leaves_after(0, NEAR_TIE_NATS) == (position, pytest.approx(gap, abs=1e-3))
        return
    pytest.fail("no prompt's flipped answer read back in the tokens it was made of")
